"""The ``tqvec`` command: bench, demo, encode, decode, info."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

__all__ = ["main"]

_CHUNK = 65536


def _codec_from_args(a: argparse.Namespace, d: int):
    from .codecs import QJL, PolarQuant, TurboQuant

    if a.codec == "turboquant":
        return TurboQuant(d, a.bits, a.variant, a.seed, rotation=a.rotation,
                          sketch_dim=a.sketch_dim, norm_dtype=a.norm_dtype)
    if a.codec == "qjl":
        return QJL(d, a.sketch_dim or a.bits * d, a.seed, norm_dtype=a.norm_dtype)
    levels = tuple(int(s) for s in a.level_bits.split(","))
    return PolarQuant(d, levels, a.seed, rotation=a.rotation)


def _check_output(a: argparse.Namespace) -> None:
    """The output must be a new name or a regular file other than the input (a write replaces
    it; it never writes through a symlink or onto a device, and never eats its own input)."""
    from .io import check_writable

    check_writable(a.output, "output")
    if os.path.exists(a.output) and os.path.samefile(a.input, a.output):
        raise ValueError(f"output must not be the input file, got {a.output!r} for both")


def _load_array(path: str) -> np.ndarray:
    """A .npy file's array, read without following it into pickles; a FIFO or device is
    refused (np.load would block on a FIFO)."""
    from .io import open_regular

    fd, _ = open_regular(path)
    os.close(fd)
    try:
        x = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"input must be a .npy file holding one array, got {path!r}: {e}") from e
    if not isinstance(x, np.ndarray):  # an .npz archive
        raise ValueError(f"input must be a .npy file holding one array, got an archive "
                         f"{path!r} (np.savez); save one array with np.save")
    return x


def _encode(a: argparse.Namespace) -> int:
    from .codecs import concat_codes
    from .codecs.storage import save_codes

    x = _load_array(a.input)
    _check_output(a)
    if x.ndim != 2:
        raise ValueError(f"input must hold a 2-D (n, d) array, got shape {x.shape}")
    codec = _codec_from_args(a, x.shape[1])
    parts = [codec.encode(np.ascontiguousarray(x[s:s + _CHUNK]))
             for s in range(0, max(len(x), 1), _CHUNK)] if len(x) else [codec.encode(
                 np.zeros((0, x.shape[1]), np.float32))]
    codes = concat_codes(parts)
    save_codes(a.output, codes)
    print(f"{len(codes)} vectors x {codec.dim} -> {a.output}: {codec!r}, "
          f"{codes.code_size} B/vector ({8 * codes.code_size / codec.dim:.3f} bits/coord), "
          f"{x.nbytes / max(codes.nbytes, 1):.1f}x smaller than {x.dtype}")
    return 0


def _decode(a: argparse.Namespace) -> int:
    from .codecs import codec_from_params
    from .codecs.storage import load_codes
    from .io import atomic_write

    codes = load_codes(a.input, mmap=True)
    _check_output(a)
    x = codec_from_params(codes.params).decode(codes, like=np.empty(0))
    atomic_write(a.output, lambda f: np.save(f, x, allow_pickle=False))
    print(f"{len(codes)} vectors -> {a.output} ({x.dtype}, shape {x.shape})")
    return 0


def _info(a: argparse.Namespace) -> int:
    from .io import read_container

    meta, arrays, _ = read_container(a.input, "codes", mmap=True)
    info = {"path": a.input, **meta,
            "arrays": {k: {"dtype": str(v.dtype), "shape": list(v.shape)}
                       for k, v in arrays.items()}}
    print(json.dumps(info, indent=1))
    return 0


def _demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(a.dataset, [int(b) for b in a.bits.split(",")], n=a.n, dim=a.dim,
             use_faiss=not a.no_faiss, json_path=a.json, progress=not a.quiet)
    return 0


def _bench(a: argparse.Namespace) -> int:
    from .benchmark import main as bench_main

    return bench_main(a.args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqvec", description="Data-oblivious vector quantization.")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("encode", help="encode an (n, d) .npy array into a codes file")
    e.add_argument("input")
    e.add_argument("output")
    e.add_argument("--codec", choices=["turboquant", "qjl", "polarquant"], default="turboquant")
    e.add_argument("--bits", type=int, default=4, help="bits per coordinate (default 4)")
    e.add_argument("--variant", choices=["mse", "prod"], default="mse")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--rotation", choices=["hadamard", "haar"], default="hadamard")
    e.add_argument("--sketch-dim", type=int, default=None, help="QJL rows (default bits*d)")
    e.add_argument("--level-bits", default="4,2,2,2", help="PolarQuant bits per level")
    e.add_argument("--norm-dtype", choices=["float32", "float16"], default="float32")
    e.set_defaults(fn=_encode)

    d = sub.add_parser("decode", help="decode a codes file into an .npy array")
    d.add_argument("input")
    d.add_argument("output")
    d.set_defaults(fn=_decode)

    i = sub.add_parser("info", help="print a codes file's header")
    i.add_argument("input")
    i.set_defaults(fn=_info)

    b = sub.add_parser("bench", add_help=False,
                       help="search benchmark: tqvec indexes vs faiss at equal bytes "
                            "(recall, QPS, build time); tqvec bench --help for options")
    b.add_argument("args", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)

    m = sub.add_parser("demo", help="compare every codec at 1-4 bits (and faiss) on real data")
    m.add_argument("--dataset", choices=["digits", "random"], default="digits",
                   help="digits: scikit-learn's bundled 1,797 x 64 (no download); random: "
                        "Gaussian n x dim")
    m.add_argument("--bits", default="1,2,3,4")
    m.add_argument("--n", type=int, default=20000, help="rows for --dataset random")
    m.add_argument("--dim", type=int, default=384, help="dim for --dataset random")
    m.add_argument("--no-faiss", action="store_true")
    m.add_argument("--json", default=None, help="also write the results as JSON")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser (tqvec.benchmark), options passed through
        args = argparse.Namespace(cmd="bench", args=argv[1:], fn=_bench)
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"tqvec {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
