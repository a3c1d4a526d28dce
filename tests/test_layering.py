"""The package's structure, enforced: layers import only downwards (tools -> index / kv ->
codecs -> random / codebooks -> ops -> the shared base modules -> kernels), no module imports
another's private names or reads another object's, and no two modules import each other
(directly or through others)."""

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tqvec"

TOOLS = ("cli", "benchmark", "demo", "datasets", "_machine")
ABOVE_OPS = ("codecs", "index", "kv", "distributed", "random", "codebooks") + TOOLS
# layer (a subpackage or a top-level module) -> the tqvec subpackages/modules it must not import
FORBIDDEN = {
    "ops": ABOVE_OPS,
    "random": ("codecs", "index", "kv", "distributed") + TOOLS,
    "codebooks": ("ops",) + ABOVE_OPS,
    "codecs": ("index", "kv", "distributed") + TOOLS,
    "index": ("kv", "distributed") + TOOLS,
    "kv": ("index", "distributed") + TOOLS,
    "distributed": ("kv",) + TOOLS,
    # the shared base: user-input checks, errors, the file container, plain metrics
    **{base: ("ops",) + ABOVE_OPS for base in ("_validate", "errors", "io", "_argtypes",
                                                "_version", "evaluate")},
}
# a module of another package's name space whose private-looking name is its real one
PRIVATE_MODULES = {"_C"}  # the compiled extension, tqvec._C
# private names of other libraries that tqvec uses on purpose (each with its reason)
ALLOWED_PRIVATE = {
    "_attn_implementation",  # transformers' config switch for a registered attention function
    "_compile_kernel",  # torch's NVRTC entry (ops/cuda.py, behind a version check)
    "_utils",  # torch.cuda._utils, same
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else path.stem


def _type_checking_only(tree) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
                node.test.id == "TYPE_CHECKING":
            out |= {id(n) for b in node.body for n in ast.walk(b)}
    return out


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, tree) -> list[tuple[ast.ImportFrom, str]]:
    """Each ``from tqvec... import`` (absolute or relative) with its resolved target module."""
    pkg = _module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = pkg[: len(pkg) - (node.level - 1)]
            target = ".".join(base + (node.module.split(".") if node.module else []))
        else:
            target = node.module or ""
        if target == "tqvec" or target.startswith("tqvec."):
            out.append((node, target))
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    bad = []
    for path, tree in _modules():
        if _layer(path) != layer:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                # relative: resolve against the module's package
                rel = path.relative_to(PKG).parts
                base = list(rel[:-1])[: len(rel) - node.level]
                target = base + (node.module.split(".") if node.module else [])
                names = [target[0]] if target else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tqvec."):
                names = [node.module.split(".")[1]]
            else:
                continue
            bad += [f"{path.relative_to(PKG)}:{node.lineno} imports {n}" for n in names
                    if n in FORBIDDEN[layer]]
    assert not bad, bad


def test_no_module_reads_another_objects_private_names():
    bad = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and re.fullmatch(r"_[a-z]\w*", node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super"):
                continue
            if node.attr in ALLOWED_PRIVATE:
                continue
            bad.append(f"{path.relative_to(PKG)}:{node.lineno} .{node.attr}")
    assert not bad, bad


def test_no_module_imports_another_modules_private_names():
    bad = []
    for path, tree in _modules():
        for node, target in _imports(path, tree):
            bad += [f"{path.relative_to(PKG)}:{node.lineno} imports {target}.{a.name}"
                    for a in node.names if a.name.startswith("_")
                    and not a.name.startswith("__") and a.name not in PRIVATE_MODULES
                    and not (PKG.parent / target.replace(".", "/") / f"{a.name}.py").exists()
                    and not (PKG.parent / target.replace(".", "/") / a.name).is_dir()]
    assert not bad, bad


def test_no_import_circle():
    """The modules' run-time imports (not ``TYPE_CHECKING`` ones) form no cycle; a package's
    ``__init__`` counts as the package (the root's re-exports excepted: it imports all)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        deps = set()
        for node, target in _imports(path, tree):
            if id(node) in skip:
                continue
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    deps.add(f"{target}.{a.name}")
                elif target in modules and target != "tqvec":
                    deps.add(target)
        graph[name] = deps - {name}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
