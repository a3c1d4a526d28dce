"""The ``tqvec`` command: bench, demo, encode, decode, info."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO

import numpy as np

from ._argtypes import bit_list, positive_int

__all__ = ["main", "build_parser"]

_CHUNK = 65536
#: ``tqvec decode`` writes its output in chunks of about this many bytes of float32 rows: a
#: 1-bit sketch decodes to d floats per few bytes, so the output can be ~10^5 x the input.
DECODE_CHUNK_BYTES = 64 << 20
_NPY_MAGIC = b"\x93NUMPY"


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help with every option's default (none shown for flags and unset options) and the
    examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and action.option_strings
                and not any(action.default is v for v in (None, False, argparse.SUPPRESS))):
            default = action.default
            if isinstance(default, list):
                default = ",".join(str(v) for v in default)
            text += f" (default: {default})"
        return text


def _codec_from_args(a: argparse.Namespace, d: int):
    from .codecs import QJL, PolarQuant, TurboQuant

    if a.codec == "turboquant":
        return TurboQuant(d, a.bits, a.variant, a.seed, rotation=a.rotation,
                          sketch_dim=a.sketch_dim, norm_dtype=a.norm_dtype)
    if a.codec == "qjl":
        m = a.bits * d if a.sketch_dim is None else a.sketch_dim
        return QJL(d, m, a.seed, norm_dtype=a.norm_dtype)
    levels = tuple(int(s) for s in a.level_bits.split(","))
    return PolarQuant(d, levels, a.seed, rotation=a.rotation)


def _check_output(a: argparse.Namespace) -> None:
    """The output must be a new name, or with --force a regular file other than the input (a
    write replaces it atomically; it never writes through a symlink or onto a device, and never
    over its own input, whatever the name)."""
    from .io import check_writable

    check_writable(a.output, "output")
    if os.path.exists(a.output):
        if os.path.samefile(a.input, a.output):
            raise ValueError(f"output must not be the input file, got {a.output!r} for both")
        if not a.force:
            raise ValueError(f"output {a.output!r} exists: pass --force to replace it")


def _load_array(path: str) -> np.ndarray:
    """A .npy file's array, read without following it into pickles; a FIFO or device is
    refused (np.load would block on a FIFO)."""
    from .io import open_regular

    fd, _ = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        head = f.read(len(_NPY_MAGIC))
    if head[:4] == b"PK\x03\x04":  # a zip: np.savez's .npz
        raise ValueError(f"input must be a .npy file holding one array, got an archive "
                         f"{path!r} (np.savez); save one array with np.save")
    if head != _NPY_MAGIC:
        raise ValueError(f"input must be a .npy file (np.save), got {path!r}, which does not "
                         f"start with numpy's magic {_NPY_MAGIC!r}")
    try:
        x = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e):
            raise ValueError(f"input must hold a numeric array, got {path!r}, an array of "
                             f"Python objects (dtype object)") from None
        raise ValueError(f"input {path!r} is a damaged .npy file: {e}") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"input {path!r} is a damaged .npy file: {e}") from None
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
             for s in range(0, len(x), _CHUNK)] or [codec.encode(
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
    codec = codec_from_params(codes.params)
    shape = (len(codes), codec.dim)
    step = max(1, DECODE_CHUNK_BYTES // (4 * codec.dim))

    def write(f: IO[bytes]) -> None:  # an .npy file, written chunk by chunk
        np.lib.format.write_array_header_2_0(f, {"descr": np.lib.format.dtype_to_descr(
            np.dtype(np.float32)), "fortran_order": False, "shape": shape})
        for s in range(0, shape[0], step):
            f.write(np.ascontiguousarray(codec.decode(codes[s:s + step], like=np.empty(0)),
                                         np.float32).tobytes())

    atomic_write(a.output, write)
    print(f"{len(codes)} vectors -> {a.output} (float32, shape {shape})")
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

    run_demo(a.dataset, a.bits, n=a.n, dim=a.dim, use_faiss=not a.no_faiss, json_path=a.json,
             progress=not a.quiet)
    return 0


def _bench(a: argparse.Namespace) -> int:
    from .benchmark import main as bench_main

    return bench_main(a.args)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="tqvec", formatter_class=_Help,
        description="Data-oblivious vector quantization: QJL, PolarQuant, TurboQuant.",
        epilog="examples:\n"
               "  tqvec bench                          search benchmark vs faiss (~1 minute)\n"
               "  tqvec encode x.npy x.tqc --bits 4    compress an (n, d) float array\n"
               "  tqvec decode x.tqc x_hat.npy         and back\n"
               "  tqvec info x.tqc                     a codes file's header\n"
               "  tqvec <command> --help               a command's options")
    p.add_argument("--version", action="version", version=f"tqvec {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="command")

    e = sub.add_parser(
        "encode", help="encode an (n, d) .npy array into a codes file", formatter_class=_Help,
        description="Encode the rows of an (n, d) float .npy array into a tqvec codes file "
                    "(atomic write, checksummed, versioned).",
        epilog="examples:\n"
               "  tqvec encode x.npy x.tqc                         TurboQuant-mse, 4 bits\n"
               "  tqvec encode x.npy x.tqc --bits 3 --variant prod unbiased inner products\n"
               "  tqvec encode x.npy x.tqc --codec qjl --sketch-dim 512\n"
               "  tqvec encode x.npy x.tqc --force                 replace an existing x.tqc")
    e.add_argument("input", help="an (n, d) float16/float32/float64 .npy file")
    e.add_argument("output", help="the codes file to write (new, or existing with --force)")
    e.add_argument("--codec", choices=["turboquant", "qjl", "polarquant"], default="turboquant",
                   help="the quantizer")
    e.add_argument("--bits", type=int, default=4, help="bits per coordinate")
    e.add_argument("--variant", choices=["mse", "prod"], default="mse",
                   help="TurboQuant: mse (smallest error) or prod (unbiased inner products)")
    e.add_argument("--seed", type=int, default=0, help="seed of the rotation and sketch")
    e.add_argument("--rotation", choices=["hadamard", "haar"], default="hadamard",
                   help="random rotation: O(d log d) Hadamard rounds or a dense Haar matrix")
    e.add_argument("--sketch-dim", type=int, default=None,
                   help="QJL / TurboQuant-prod sketch rows (default: bits * d, resp. d)")
    e.add_argument("--level-bits", default="4,2,2,2", help="PolarQuant bits per level")
    e.add_argument("--norm-dtype", choices=["float32", "float16"], default="float32",
                   help="how the per-vector norm is stored (float16: 2 bytes less)")
    e.add_argument("--force", action="store_true", help="replace an existing output file")
    e.set_defaults(fn=_encode)

    d = sub.add_parser(
        "decode", help="decode a codes file into an .npy array", formatter_class=_Help,
        description="Decode a codes file into an (n, d) float32 .npy array (atomic write).",
        epilog="example:\n  tqvec decode x.tqc x_hat.npy")
    d.add_argument("input", help="a codes file written by tqvec encode or save_codes")
    d.add_argument("output", help="the .npy file to write (new, or existing with --force)")
    d.add_argument("--force", action="store_true", help="replace an existing output file")
    d.set_defaults(fn=_decode)

    i = sub.add_parser("info", help="print a codes file's header", formatter_class=_Help,
                       description="Print a codes file's header and arrays as JSON.",
                       epilog="example:\n  tqvec info x.tqc")
    i.add_argument("input", help="a codes file")
    i.set_defaults(fn=_info)

    b = sub.add_parser("bench", add_help=False,
                       help="search benchmark: tqvec indexes vs faiss at equal bytes "
                            "(recall, QPS, build time); tqvec bench --help for options")
    b.add_argument("args", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)

    m = sub.add_parser(
        "demo", help="distortion of every codec at 1-4 bits (and faiss) on real data",
        formatter_class=_Help,
        description="Relative MSE, SQNR and inner-product error of every codec at each bit "
                    "width, next to faiss's RR,SQtqmse.",
        epilog="examples:\n  tqvec demo\n  tqvec demo --dataset random --n 20000 --dim 384 "
               "--bits 2,4")
    m.add_argument("--dataset", choices=["digits", "random"], default="digits",
                   help="digits: scikit-learn's bundled 1,797 x 64 (no download); random: "
                        "Gaussian n x dim")
    m.add_argument("--bits", type=bit_list(range(1, 5)), default=[1, 2, 3, 4],
                   help="bit widths per coordinate, comma-separated")
    m.add_argument("--n", type=positive_int, default=20000, help="rows for --dataset random")
    m.add_argument("--dim", type=positive_int, default=384, help="dim for --dataset random")
    m.add_argument("--no-faiss", action="store_true", help="leave out faiss's rows")
    m.add_argument("--json", default=None, help="also write the results as JSON to this path")
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
