"""Compile CUDA sources with NVRTC through ctypes, exactly as tqvec.ops.cuda does at run time
(same options, no headers), without a GPU: NVRTC is a compiler library and needs no device.
Finds libnvrtc from CUDA_HOME, the loader path, or the nvidia-cuda-nvrtc wheel."""

from __future__ import annotations

import ctypes
import glob
import os
import sysconfig


def load_nvrtc() -> ctypes.CDLL | None:
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    dirs = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64")]
    dirs += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "lib"))
    dirs += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cuda_nvrtc",
                                   "lib"))
    for name in names:
        for cand in [name] + [os.path.join(d, name) for d in dirs]:
            try:
                lib = ctypes.CDLL(cand)
            except OSError:
                continue
            # NVRTC dlopens its builtins library by name: preload it from the same folder.
            folder = os.path.dirname(cand)
            for b in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            return lib
    return None


def compile_source(lib: ctypes.CDLL, src: str, kernels: list[str], arch: str,
                   options: list[str]) -> tuple[bool, str, dict[str, str]]:
    """(ok, log, kernel -> lowered name)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"tqvec.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram failed: {rc}"
    for k in kernels:
        assert lib.nvrtcAddNameExpression(prog, k.encode()) == 0
    opts = [f"--gpu-architecture=sm_{arch}".encode()] + [o.encode() for o in options]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lowered = {}
    if rc == 0:
        for k in kernels:
            name = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(prog, k.encode(), ctypes.byref(name)) == 0
            lowered[k] = name.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, buf.value.decode(errors="replace"), lowered
