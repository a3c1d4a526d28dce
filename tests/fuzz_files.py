"""A seeded, time-bounded mutation fuzzer over tqvec's files (codes and every index kind).

Each case takes one file of a small corpus and damages it the way a disk, a network or an
attacker would: flipped bytes, truncations, appended or zeroed runs, a header spliced from
another file, and crafted headers and arrays whose checksums are valid (a hostile value at any
place of the header, keys deleted or added, arrays resized, array contents replaced by NaN,
out-of-range or random values, sizes declared in the terabytes). It then reads the file
(``load_codes`` / ``read_index``, with and without mmap) and, if that succeeds, uses it: decode
and score codes, search and reconstruct an index.

A case must end, within ``case_timeout`` seconds and under an address-space limit, in one of
the allowed outcomes: ``loaded`` (read and used without error), ``FormatError``, or an
``OSError``. Anything else - another exception type, ``MemoryError``, a signal (crash) or a
time-out (hang) - is a failure, reported with the case number that reproduces it
(``--only N``).

The cases run in a worker subprocess (restarted after a crash or a hang), so that a crash is
counted, not fatal. ``tests/test_fuzz.py`` runs a fixed count of seeded cases in CI; the long
run is

    python tests/fuzz_files.py --cases 20000 --seed 1 --json bench/results/fuzz_files.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import select
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"\x89TQV\r\n\x1a\n"
ALLOWED = ("loaded", "FormatError", "OSError")
_HOSTILE = [0, -1, 1, 2, 3, 7, 8, 9, 16, 17, 255, 256, 4096, 8193, 2**20 + 1, 2**31 - 1, 2**31,
            2**32, 2**40, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -2**63, 1.5, 0.0, -0.0,
            1e308, -1e308, "", "x", "haar", "hadamard", "gaussian", "orthogonal", "l2", "ip",
            "cosine", "flat", "ivf", "turboquant", "qjl", "polarquant", "turboquant-mixed",
            "cuda", "meta", "float16", "int64", "uint8", "fit", "unbiased", "grid", None, True,
            False, [], [0], [1, 2], [[1, 2]], [[8, 4], [8, 0]], {}, {"a": 1}]
_DEEP = "__deep__"
_KEYS = ["backend", "dim", "bits", "n", "ntotal", "prefilter", "k_factor", "nprobe", "nlist",
         "sketch_dim", "rotation", "jl_version", "centered", "pca", "trained", "extra"]


# -- the corpus ------------------------------------------------------------------------------

def build_corpus(folder: Path) -> list[tuple[str, str]]:
    """Small files of every kind tqvec writes: (file name, "codes" | "index")."""
    import tqvec

    rng = np.random.default_rng(0)
    d = 16
    x = (rng.standard_normal((160, 4)) @ rng.standard_normal((4, d))
         + 0.1 * rng.standard_normal((160, d))).astype(np.float32)
    out = []
    codecs = {
        "tq3": tqvec.TurboQuant(d, 3, seed=1),
        "tq2f_haar": tqvec.TurboQuant(d, 2, seed=2, rotation="haar", scale="fit"),
        "tqprod3_m8": tqvec.TurboQuant(d, 3, "prod", seed=3, sketch_dim=8),
        "qjl_outliers": tqvec.QJL(d, 24, seed=4, outliers=[2, 5], norm_dtype="float16"),
        "polar": tqvec.PolarQuant(d, (3, 2), seed=5),
        "mixed": tqvec.MixedTurboQuant(d, [(4, 8), (6, 3), (4, 1), (2, 0)], seed=6),
    }
    for name, c in codecs.items():
        tqvec.save_codes(folder / f"{name}.tqc", c.encode(x[:40]))
        out.append((f"{name}.tqc", "codes"))
    specs = {
        "flat_tq4_l2": ("TQ4", "l2"),
        "flat_tq2_prefilter_l2": ("TQ2,Prefilter(4)", "l2"),
        "flat_center_tq2f_ip": ("Center,TQ2f", "ip"),
        "flat_tq1_refine_tq8g_cos": ("TQ1,Refine(TQ8g)", "cosine"),
        "flat_qjl32_refine_flat_ip": ("QJL32,Refine(Flat)", "ip"),
        "flat_polar_l2": ("Polar", "l2"),
        "flat_tqprod3_ip": ("TQprod3", "ip"),
        "ivf4_tq3_l2": ("IVF4,TQ3", "l2"),
        "ivf4_tq2_refine_flat_ip": ("IVF4,TQ2,Refine(Flat)", "ip"),
        "ivf4_untrained": ("IVF4,TQ2", "l2"),
        "pca_tq2_l2": ("PCA,TQ2", "l2"),
        "pca_tq2_prefilter_ip": ("PCA,TQ2,Prefilter(4)", "ip"),
        "flat_empty": ("TQ2", "l2"),
        "graph8_tq2_refine_flat_l2": ("HNSW8,TQ2,Refine(Flat)", "l2"),
        "graph4_tq1_cos": ("HNSW4,TQ1", "cosine"),
    }
    for name, (spec, metric) in specs.items():
        index = tqvec.index_factory(d, spec, metric)
        if name != "ivf4_untrained":
            index.train(x)
            if name != "flat_empty":
                index.add(x[:120])
                index.remove_ids(np.arange(0, 120, 7))
        tqvec.write_index(index, folder / f"{name}.tqv")
        out.append((f"{name}.tqv", "index"))
    return out


# -- mutations -------------------------------------------------------------------------------

def _split(data: bytes) -> tuple[dict, dict[str, bytes]] | None:
    """(header doc, {array name: bytes}) of an intact container, or None."""
    if len(data) < 48 or data[:8] != MAGIC:
        return None
    hlen = struct.unpack("<I", data[12:16])[0]
    try:
        doc = json.loads(data[16:16 + hlen])
    except ValueError:
        return None
    arrays = {e["name"]: data[e["offset"]: e["offset"] + e["nbytes"]] for e in doc["arrays"]}
    return doc, arrays


def _assemble(doc: Any, arrays: dict[str, bytes], relayout: bool = True,
              raw_header: bytes | None = None) -> bytes:
    """A container of ``doc`` with a valid header checksum; with ``relayout`` the arrays are
    placed where the writer would put them (their entries' offsets rewritten)."""
    def header_of() -> bytes:
        if raw_header is not None:
            return raw_header
        text = json.dumps(doc)
        for depth in set(re.findall(f'"{_DEEP}(\\d+)"', text)):
            text = text.replace(f'"{_DEEP}{depth}"', "[" * int(depth) + "0" + "]" * int(depth))
        return text.encode()

    entries = doc.get("arrays") if isinstance(doc, dict) else None
    ok = isinstance(entries, list) and all(isinstance(e, dict) for e in entries)
    if relayout and ok:
        for _ in range(4):
            at = 16 + len(header_of()) + 32
            for e in entries:
                nb = e.get("nbytes")
                at = (at + 63) // 64 * 64
                e["offset"] = at
                at += nb if isinstance(nb, int) and 0 <= nb < 1 << 40 else 0
    header = header_of()
    out = bytearray(MAGIC + struct.pack("<II", 1, len(header)) + header
                    + hashlib.sha256(header).digest())
    if ok:
        for e in entries:
            off = e.get("offset")
            body = arrays.get(e.get("name"), b"") if isinstance(e.get("name"), str) else b""
            if not isinstance(off, int) or not 0 <= off < 1 << 30:
                continue
            if relayout and isinstance(e.get("nbytes"), int) and 0 <= e["nbytes"] < 1 << 26:
                body = body[: e["nbytes"]].ljust(e["nbytes"], b"\0")
            if off > len(out):
                out += b"\0" * (off - len(out))
            out[off: off + len(body)] = body
    return bytes(out)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document (keys and list positions)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _hostile_value(rng: np.random.Generator, old: Any) -> Any:
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.4:
        return int(rng.choice([old + 1, old - 1, old * 2, old * 1000 + 1, -old, old // 2]))
    if rng.random() < 0.05:  # nested lists, spliced in as text (json.dumps would recurse)
        return f"{_DEEP}{int(rng.integers(50, 200000))}"
    return _HOSTILE[int(rng.integers(len(_HOSTILE)))]


def _crafted_header(doc: dict, arrays: dict, rng: np.random.Generator) -> tuple[bytes, str]:
    """One hostile change anywhere in the header (valid checksums, the writer's layout)."""
    paths = [p for p in _paths(doc) if p]
    path = paths[int(rng.integers(len(paths)))]
    parent, key = _get(doc, path[:-1]), path[-1]
    op = rng.random()
    if op < 0.7:
        parent[key] = _hostile_value(rng, parent[key])
        what = "set"
    elif op < 0.85:
        del parent[key]
        what = "delete"
    elif isinstance(parent, dict):
        parent[_KEYS[int(rng.integers(len(_KEYS)))]] = _hostile_value(rng, 0)
        what = "add"
    else:
        parent.append(parent[key])
        what = "duplicate"
    return _assemble(doc, arrays, relayout=rng.random() < 0.8), f"header-{what}:{path}"


def _crafted_array(doc: dict, arrays: dict, rng: np.random.Generator) -> tuple[bytes, str]:
    """Replace an array's contents or size, with its sha256 made valid again."""
    e = doc["arrays"][int(rng.integers(len(doc["arrays"])))]
    dt = np.dtype(e["dtype"])
    a = np.frombuffer(arrays[e["name"]], dtype=dt).copy()
    op = int(rng.integers(5))
    if op == 0 and a.size:  # hostile values in place
        idx = rng.integers(0, a.size, int(rng.integers(1, 4)))
        if dt.kind == "f":
            a[idx] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, -1.0])
        else:
            info = np.iinfo(dt)
            a[idx] = rng.choice([info.min, info.max, -1, 0, 1 << 20, int(info.max) // 2]
                                if dt.kind == "i" else [0, info.max])
        what = "values"
    elif op == 1 and a.size:  # random bytes
        a = np.frombuffer(rng.bytes(a.nbytes), dtype=dt).copy()
        what = "random"
    else:  # another row count, consistent in the entry
        shape = list(e["shape"]) or [1]
        shape[0] = int(rng.choice([0, 1, max(shape[0] - 1, 0), shape[0] + 1, shape[0] * 2]))
        per = int(np.prod(shape[1:], dtype=np.int64))
        a = np.resize(a, shape[0] * per) if a.size else np.zeros(shape[0] * per, dt)
        e["shape"] = shape if e["shape"] else []
        what = "rows"
    raw = a.tobytes()
    e["nbytes"] = len(raw)
    e["sha256"] = hashlib.sha256(raw).hexdigest()
    arrays = dict(arrays, **{e["name"]: raw})
    return _assemble(doc, arrays), f"array-{what}:{e['name']}"


def _huge_sizes(doc: dict, arrays: dict, rng: np.random.Generator) -> tuple[bytes, str]:
    """Declare an array of terabytes (or an absurd count) with consistent shape and nbytes."""
    e = doc["arrays"][int(rng.integers(len(doc["arrays"])))]
    big = int(rng.choice([2**31, 2**40, 2**50, 2**61]))
    shape = list(e["shape"]) or [1]
    shape[0] = big
    e["shape"] = shape
    e["nbytes"] = int(np.prod(shape, dtype=object)) * np.dtype(e["dtype"]).itemsize
    if rng.random() < 0.5 and isinstance(doc.get("meta"), dict):
        for k in ("n", "ntotal"):
            if k in doc["meta"]:
                doc["meta"][k] = big
    return _assemble(doc, arrays, relayout=rng.random() < 0.5), f"huge:{e['name']}"


def mutate(data: bytes, other: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One damaged version of ``data`` and a label of what was done."""
    kind = int(rng.integers(15))  # 5 kinds of raw damage, then crafted headers and arrays
    n = len(data)
    if kind == 0:
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(n))] ^= int(rng.integers(1, 256))
        return bytes(b), "flip"
    if kind == 1:
        cut = int(rng.integers(n))
        return data[:cut], f"truncate:{cut}"
    if kind == 2:
        return data + rng.bytes(int(rng.integers(1, 200))), "append"
    if kind == 3:
        at = int(rng.integers(n))
        return data[:at] + b"\0" * min(64, n - at) + data[at + 64:], f"zero:{at}"
    if kind == 4:  # another file's header over this file's body
        hlen = struct.unpack("<I", other[12:16])[0]
        my = struct.unpack("<I", data[12:16])[0]
        return other[: 16 + hlen + 32] + data[16 + my + 32:], "splice"
    doc, arrays = _split(data)
    if kind < 10 or not doc["arrays"]:
        return _crafted_header(doc, arrays, rng)
    if kind == 14:
        return _huge_sizes(doc, arrays, rng)
    return _crafted_array(doc, arrays, rng)


# -- the worker ----------------------------------------------------------------------------

#: A loaded file whose codec would draw more than this (``Codec.draw_work``: ~1 s) is not used:
#: its fingerprint check waits for the first use (``tqvec.codecs.storage.verify_fingerprints``),
#: which a genuine file of that header pays too; tests/test_io.py covers that check.
USE_DRAW_LIMIT = 1 << 31


def _use(obj: Any, kind: str) -> bool:
    """Use what loaded as a user would; False where its draw is too costly to try."""
    import tqvec

    inner = getattr(obj, "index", obj)  # a PCA index's inner index (None before train)
    codec = tqvec.codec_from_params(obj.params) if kind == "codes" else getattr(
        inner, "codec", None)
    drawn = [codec, getattr(inner, "refine", None)]
    if sum(c.draw_work() for c in drawn if isinstance(c, tqvec.Codec)) > USE_DRAW_LIMIT:
        return False
    if kind == "codes":
        c = codec
        head = obj[: min(8, len(obj))]
        c.decode(head)
        c.score(np.ones((2, c.dim), np.float32), head)
        return True
    d = obj.d
    q = np.random.default_rng(1).standard_normal((2, d)).astype(np.float32)
    if not obj.is_trained:
        return True
    obj.search(q, 5)
    obj.search(q[:1], 1)
    if obj.ntotal:
        obj.search(q, 3, allowed_ids=np.arange(0, 200, 3))
        first = int(obj.search(q[:1], 1)[1][0, 0])
        if first >= 0:
            obj.reconstruct(first)
    return True


def _worker(folder: str, seed: int, start: int, stop: int, memory_gb: float) -> None:
    import resource

    lim = int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    import torch

    torch.set_num_threads(1)
    import tqvec

    corpus = json.loads((Path(folder) / "corpus.json").read_text())
    blobs = [(Path(folder) / name).read_bytes() for name, _ in corpus]
    target = Path(folder) / "case.bin"
    for i in range(start, stop):
        rng = np.random.default_rng([seed, i])
        j = int(rng.integers(len(corpus)))
        data, label = mutate(blobs[j], blobs[int(rng.integers(len(blobs)))], rng)
        use_mmap = bool(rng.random() < 0.5)
        name, kind = corpus[j]
        print(f"BEGIN {i}", flush=True)
        target.write_bytes(data)
        try:
            obj = (tqvec.load_codes if kind == "codes" else tqvec.read_index)(target,
                                                                              mmap=use_mmap)
            outcome, msg = ("loaded", "") if _use(obj, kind) else ("loaded", "not used")
            del obj
        except tqvec.FormatError as e:
            outcome, msg = "FormatError", str(e)
        except OSError as e:
            outcome, msg = "OSError", f"{type(e).__name__}: {e}"
        except BaseException as e:  # noqa: BLE001 - every other outcome is a finding
            outcome, msg = type(e).__name__, str(e)
        print("END " + json.dumps({"case": i, "file": name, "mutation": label, "mmap": use_mmap,
                                   "outcome": outcome, "message": msg[:300]}), flush=True)


# -- the driver ------------------------------------------------------------------------------

def run_fuzz(folder: Path, seed: int = 0, cases: int = 1000, seconds: float = 60.0,
             case_timeout: float = 30.0, memory_gb: float = 4.0, only: int | None = None
             ) -> dict[str, Any]:
    """Run cases ``0 .. cases-1`` (or just ``only``) until ``seconds`` have passed; returns
    ``{"cases", "outcomes": {outcome: count}, "mutations": {kind: count}, "failures": [...]}``
    where crashes and hangs count as outcomes ``crash:<signal>`` and ``hang``."""
    folder = Path(folder)
    corpus = build_corpus(folder)
    (folder / "corpus.json").write_text(json.dumps(corpus))
    start, stop = (only, only + 1) if only is not None else (0, cases)
    outcomes: Counter = Counter()
    mutations: Counter = Counter()
    failures: list[dict] = []
    t0 = time.monotonic()
    done = 0
    i = start
    log = folder / "worker.err"
    while i < stop and time.monotonic() - t0 < seconds:
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", __file__, "--worker", str(folder),
                 "--seed", str(seed), "--start", str(i), "--stop", str(stop),
                 "--memory-gb", str(memory_gb)],
                stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        current = None  # the case the worker is in
        try:
            while True:
                # a case gets case_timeout; the worker's start (imports) gets 120 s
                ready, _, _ = select.select([proc.stdout], [], [],
                                            case_timeout if current is not None else 120.0)
                if not ready:
                    proc.kill()
                    if current is None:
                        raise RuntimeError(f"the fuzz worker did not start: "
                                           f"{log.read_text()[-2000:]}")
                    outcomes["hang"] += 1
                    failures.append({"case": current, "outcome": "hang"})
                    done += 1
                    i = current + 1
                    break
                line = proc.stdout.readline()
                if not line:  # the worker died: a crash in case `current`, or it finished
                    proc.wait()
                    if current is None:
                        if proc.returncode != 0:  # outside a case: the fuzzer's own bug
                            raise RuntimeError(f"the fuzz worker failed between cases: "
                                               f"{log.read_text()[-2000:]}")
                        i = stop
                        break
                    sig = -proc.returncode if proc.returncode < 0 else proc.returncode
                    outcomes[f"crash:{sig}"] += 1
                    failures.append({"case": current, "outcome": f"crash:{sig}",
                                     "stderr": log.read_text()[-1500:]})
                    done += 1
                    i = current + 1
                    break
                if line.startswith("BEGIN "):
                    current = int(line.split()[1])
                    if time.monotonic() - t0 > seconds:  # out of time: not run, not counted
                        i = stop
                        break
                elif line.startswith("END "):
                    rec = json.loads(line[4:])
                    current = None
                    done += 1
                    i = rec["case"] + 1
                    outcomes[rec["outcome"]] += 1
                    mutations[rec["mutation"].split(":")[0]] += 1
                    if rec["outcome"] not in ALLOWED:
                        failures.append(rec)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return {"seed": seed, "cases": done, "seconds": round(time.monotonic() - t0, 1),
            "case_timeout": case_timeout, "memory_gb": memory_gb,
            "outcomes": dict(outcomes), "mutations": dict(mutations), "failures": failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--case-timeout", type=float, default=30.0)
    p.add_argument("--memory-gb", type=float, default=4.0)
    p.add_argument("--only", type=int, default=None, help="run one case (to reproduce it)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.worker, a.seed, a.start, a.stop, a.memory_gb)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        report = run_fuzz(Path(tmp), a.seed, a.cases, a.seconds, a.case_timeout, a.memory_gb,
                          a.only)
    text = json.dumps(report, indent=1)
    print(text)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        Path(a.json).write_text(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
