"""The package's structure, enforced: layers import only downwards (tools -> index / kv ->
codecs -> ops -> kernels), and no module reads another object's private names."""

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tqvec"

# layer -> the tqvec subpackages/modules it must not import
FORBIDDEN = {
    "ops": ("codecs", "index", "kv", "cli", "benchmark", "demo", "datasets", "distributed"),
    "codecs": ("index", "kv", "cli", "benchmark", "demo", "distributed"),
    "index": ("kv", "cli", "benchmark", "demo", "distributed"),
    "kv": ("index", "cli", "benchmark", "demo", "distributed"),
    "distributed": ("kv", "cli", "benchmark", "demo"),
}
# private names of other libraries that tqvec uses on purpose (each with its reason)
ALLOWED_PRIVATE = {
    "_attn_implementation",  # transformers' config switch for a registered attention function
    "_compile_kernel",  # torch's NVRTC entry (ops/cuda.py, behind a version check)
    "_utils",  # torch.cuda._utils, same
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    bad = []
    for path, tree in _modules():
        rel = path.relative_to(PKG).parts
        if rel[0] != layer:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                # relative: resolve against the module's package
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
