"""The ops table and its one dispatcher: each op has a torch reference (its meaning, ``ref.py``)
and optionally a compiled CPU kernel (``cpu.py``, ``tqvec._C``) and a CUDA kernel
(``cuda.py``, NVRTC); ``pick`` chooses per call by the tensor's device and the backend asked
for. Prepared ops (``prepared.py``) are rows of the same table whose implementations map an
argument struct to a runner, chosen once per struct by the same ``pick``.

CPU tensors go to the compiled kernel when ``tqvec._C`` imported, CUDA tensors to the CUDA
kernel when it is available; ``backend="auto"`` falls back to the reference (one logged warning
per backend), an explicitly requested backend that is missing raises ``BackendUnavailable``. An
op without a kernel for a device runs its reference there (torch on a GPU is its CUDA version).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import BackendUnavailable
from . import cpu as _cpu
from . import cuda as _cuda
from . import kvstep as _kvstep
from . import prepared_cpu as _pcpu
from . import prepared_ref as _pref
from . import ref as _ref

__all__ = ["BACKENDS", "Op", "OPS", "pick", "available_backends", "compiled_cpu"]

BACKENDS = ("auto", "ref", "cpu", "cuda")


@dataclass(frozen=True)
class Op:
    """One op's implementations: the reference and, where written, its kernels."""

    ref: Callable
    cpu: Callable | None = None
    cuda: Callable | None = None


OPS: dict[str, Op] = {
    "pack_bits": Op(_ref.pack_bits_ref, _cpu.pack_bits_cpu, _cuda.pack_bits_cuda),
    "unpack_bits": Op(_ref.unpack_bits_ref, _cpu.unpack_bits_cpu, _cuda.unpack_bits_cuda),
    "quantize_pack": Op(_ref.quantize_pack_ref, _cpu.quantize_pack_cpu,
                        _cuda.quantize_pack_cuda),
    "centroid_stats": Op(_ref.centroid_stats_ref, _cpu.centroid_stats_cpu),
    "turbo_mse_encode": Op(_ref.turbo_mse_encode_ref, _cpu.turbo_mse_encode_cpu),
    "turbo_mse_decode": Op(_ref.turbo_mse_decode_ref, _cpu.turbo_mse_decode_cpu),
    "hadamard_rotate": Op(_ref.hadamard_rotate_ref, _cpu.hadamard_rotate_cpu,
                          _cuda.hadamard_rotate_cuda),
    "lut_scan": Op(_ref.lut_scan_ref, _cpu.lut_scan_cpu, _cuda.lut_scan_cuda),
    "lut_rescore": Op(_ref.lut_rescore_ref, _cpu.lut_rescore_cpu),
    "block_codes": Op(_ref.block_codes_ref, _cpu.block_codes_cpu),
    "block_code_rows": Op(_ref.block_code_rows_ref, _cpu.block_code_rows_cpu),
    "fast_scan": Op(_ref.fast_scan_ref, _cpu.fast_scan_cpu),
    "fast_scan_terms": Op(_ref.fast_scan_terms_ref, _cpu.fast_scan_terms_cpu),
    "fast_scan_terms_two_stage": Op(_ref.fast_scan_terms_two_stage_ref,
                                    _cpu.fast_scan_terms_two_stage_cpu),
    "fast_scan_two_stage": Op(_ref.fast_scan_two_stage_ref, _cpu.fast_scan_two_stage_cpu),
    "ivf_fast_scan": Op(_ref.ivf_fast_scan_ref, _cpu.ivf_fast_scan_cpu),
    "ivf_probe": Op(_ref.ivf_probe_ref, _cpu.ivf_probe_cpu),
    "row_sqnorms": Op(_ref.row_sqnorms_ref, _cpu.row_sqnorms_cpu),
    "row_dots": Op(_ref.row_dots_ref, _cpu.row_dots_cpu),
    "row_project": Op(_ref.row_project_ref, _cpu.row_project_cpu),
    "rescore_topk": Op(_ref.rescore_topk_ref, _cpu.rescore_topk_cpu),
    "decode_attention": Op(_ref.decode_attention_ref, _cpu.decode_attention_cpu,
                           _cuda.decode_attention_cuda),
    "attention_step": Op(_kvstep.attention_step_ref, _cpu.attention_step_cpu,
                         _cuda.attention_step_cuda),
    # prepared ops (``prepared.py``): each implementation maps the op's argument struct to a
    # runner, or to None where that kernel cannot take it
    "hadamard_rotate_prepared": Op(_pref.hadamard_rotate_runner, _pcpu.hadamard_rotate_runner,
                                   _cuda.hadamard_rotate_runner),
    "fast_scan_prepared": Op(_pref.fast_scan_runner, _pcpu.fast_scan_runner),
    "ivf_fast_scan_prepared": Op(_pref.ivf_fast_scan_runner, _pcpu.ivf_fast_scan_runner),
    "ivf_probe_prepared": Op(_pref.ivf_probe_runner, _pcpu.ivf_probe_runner),
    # fused searches: the reference is the index's composition of its prepared parts
    "flat_search_fused": Op(_pref.no_fused, _pcpu.flat_search),
    "terms_search_fused": Op(_pref.no_fused, _pcpu.terms_search),
    "ivf_search_fused": Op(_pref.no_fused, _pcpu.ivf_search),
    "graph_search": Op(_pref.no_fused, _pcpu.graph_search),
}

_log = logging.getLogger("tqvec")
_warned: set[str] = set()
_lock = threading.Lock()


def available_backends() -> tuple[str, ...]:
    out = ["ref"]
    if _cpu.available():
        out.append("cpu")
    if _cuda.available():
        out.append("cuda")
    return tuple(out)


def _warn_once(key: str, msg: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    _log.warning(msg)


def pick(name: str, device: torch.device, backend: str) -> Callable:
    """The implementation of op ``name`` for a tensor on ``device`` under ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    op = OPS[name]
    if backend == "ref":
        return op.ref
    if device.type == "cuda":
        if backend == "cpu":
            raise BackendUnavailable("backend 'cpu' cannot run on a cuda tensor")
        why = _cuda.unavailable_reason()
        if why is None:
            return op.cuda or op.ref  # no CUDA kernel: the reference runs on the GPU
        if backend == "cuda":
            raise BackendUnavailable(f"backend 'cuda' is not available for {name}: {why}")
        _warn_once("cuda", f"tqvec CUDA kernels are not available ({why}); using the torch "
                           "reference ops on the GPU (slower)")
        return op.ref
    if backend == "cuda":
        raise BackendUnavailable(f"backend 'cuda' cannot run on a {device.type} tensor"
                                 + ("" if _cuda.available() else
                                    f" (and it is not available: {_cuda.unavailable_reason()})"))
    if device.type != "cpu":
        if backend == "cpu":
            raise BackendUnavailable(f"backend 'cpu' cannot run on a {device.type} tensor")
        return op.ref
    if op.cpu is None:  # no CPU kernel for this op: the reference is its CPU implementation
        if backend == "cpu":
            raise BackendUnavailable(f"backend 'cpu' has no compiled kernel for {name}")
        return op.ref
    if _cpu.available():
        return op.cpu
    if backend == "cpu":
        raise BackendUnavailable(
            f"backend 'cpu' needs the compiled module tqvec._C, which failed to import: "
            f"{_cpu.IMPORT_ERROR}")
    _warn_once("cpu", f"tqvec._C is not available ({_cpu.IMPORT_ERROR}); using the torch "
                      "reference ops (slower)")
    return op.ref


def compiled_cpu(name: str, device: torch.device, backend: str) -> bool:
    """Whether op ``name`` runs on the compiled CPU kernel here (then prepared ops keep numpy
    views of their arrays and call it directly)."""
    op = OPS[name]
    return op.cpu is not None and pick(name, device, backend) is op.cpu
