"""Dataset loaders. The embedded default needs no download: scikit-learn's bundled digits
(1,797 real 8x8 handwritten digits, 64-d, pixel values 0..16), which ships inside the
scikit-learn wheel. Larger real sets (Fashion-MNIST, MiniLM embeddings) come as ann-benchmarks
HDF5 files built by the recipes in ``datasets/``."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["EMBEDDED", "load_embedded", "split_queries", "read_hdf5", "write_hdf5", "ground_truth",
           "read_idx", "build_fashion_mnist", "load_ann", "data_dir"]

EMBEDDED = ("digits", "random")


def load_embedded(name: str = "digits", *, n: int = 100_000, dim: int = 384, seed: int = 0
                  ) -> np.ndarray:
    """Return an (n, d) float32 matrix.

    ``digits``: scikit-learn's bundled digits (real data, 1,797 x 64).
    ``random``: n standard Gaussian vectors of ``dim`` (directions uniform on the sphere, the
    case the papers' bounds are stated for).
    """
    if name == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:  # pragma: no cover
            raise ImportError("the 'digits' dataset needs scikit-learn: pip install "
                              "'tqvec[tools]'") from e
        return load_digits().data.astype(np.float32)
    if name == "random":
        return np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    raise ValueError(f"dataset must be one of {list(EMBEDDED)}, got {name!r}")


def split_queries(x: np.ndarray, nq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``nq`` random rows as queries: returns ``(base, queries)``."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(x))
    return x[perm[nq:]], x[perm[:nq]]


# -- ann-benchmarks HDF5 ----------------------------------------------------------------------

ANN_DISTANCES = ("euclidean", "angular", "dot")
FASHION_DIRS = ("/usr/share/datasets/fashion-mnist",)  # Debian's dataset-fashion-mnist


def data_dir() -> str:
    """Where built datasets are cached: $TQVEC_DATA or ~/.cache/tqvec (never the repo)."""
    return os.environ.get("TQVEC_DATA", os.path.join(os.path.expanduser("~"), ".cache", "tqvec"))


def read_hdf5(path: str) -> dict:
    """Read an ann-benchmarks file: train (n, d), test (nq, d), neighbors (nq, k) int,
    distances (nq, k), and attrs['distance'] ('euclidean' | 'angular' | 'dot'); validated."""
    try:
        import h5py
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading ann-benchmarks files needs h5py: pip install "
                          "'tqvec[tools]'") from e
    from .errors import FormatError

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise FormatError(f"{path!r} is not a readable HDF5 file: {e}") from e
    with f:
        missing = [k for k in ("train", "test", "neighbors") if k not in f]
        if missing:
            raise FormatError(f"{path!r} must hold datasets train, test, neighbors (ann-benchmarks"
                              f" schema), missing {missing}")
        out = {k: np.asarray(f[k]) for k in ("train", "test", "neighbors", "distances") if k in f}
        dist = f.attrs.get("distance", "euclidean")
        dist = dist.decode() if isinstance(dist, bytes) else str(dist)
    if dist not in ANN_DISTANCES:
        raise FormatError(f"{path!r}: attrs['distance'] must be one of {list(ANN_DISTANCES)}, "
                          f"got {dist!r}")
    tr, te, nb = out["train"], out["test"], out["neighbors"]
    if tr.ndim != 2 or te.ndim != 2 or tr.shape[1] != te.shape[1]:
        raise FormatError(f"{path!r}: train and test must be 2-D with equal d, got {tr.shape}, "
                          f"{te.shape}")
    if nb.ndim != 2 or nb.shape[0] != te.shape[0]:
        raise FormatError(f"{path!r}: neighbors must be (nq, k) with nq = {te.shape[0]}, got "
                          f"{nb.shape}")
    out["train"] = tr.astype(np.float32, copy=False)
    out["test"] = te.astype(np.float32, copy=False)
    out["neighbors"] = nb.astype(np.int64, copy=False)
    out["distance"] = dist
    return out


def ground_truth(train: np.ndarray, test: np.ndarray, k: int, distance: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k (neighbors, distances) by brute force (faiss IndexFlat)."""
    import faiss

    d = train.shape[1]
    if distance == "euclidean":
        index = faiss.IndexFlatL2(d)
        index.add(np.ascontiguousarray(train, dtype=np.float32))
        D, I = index.search(np.ascontiguousarray(test, dtype=np.float32), k)
        return I, np.sqrt(np.maximum(D, 0))
    if distance == "angular":
        tn = train / np.linalg.norm(train, axis=1, keepdims=True).clip(1e-30)
        qn = test / np.linalg.norm(test, axis=1, keepdims=True).clip(1e-30)
        index = faiss.IndexFlatIP(d)
        index.add(np.ascontiguousarray(tn, dtype=np.float32))
        D, I = index.search(np.ascontiguousarray(qn, dtype=np.float32), k)
        return I, 1 - D
    index = faiss.IndexFlatIP(d)
    index.add(np.ascontiguousarray(train, dtype=np.float32))
    D, I = index.search(np.ascontiguousarray(test, dtype=np.float32), k)
    return I, -D


def write_hdf5(path: str, train: np.ndarray, test: np.ndarray, distance: str, k: int = 100
               ) -> None:
    """Write an ann-benchmarks file (with exact ground truth), atomically."""
    import h5py

    from .io import create_temp

    if distance not in ANN_DISTANCES:
        raise ValueError(f"distance must be one of {list(ANN_DISTANCES)}, got {distance!r}")
    nb, dist = ground_truth(train, test, min(k, len(train)), distance)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = create_temp(folder)  # the mode open() gives; HDF5 locks it while it writes
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["distance"] = distance
            f.attrs["type"] = "dense"
            f.create_dataset("train", data=train.astype(np.float32))
            f.create_dataset("test", data=test.astype(np.float32))
            f.create_dataset("neighbors", data=nb.astype(np.int32))
            f.create_dataset("distances", data=dist.astype(np.float32))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_idx(path: str) -> np.ndarray:
    """Read a (gzipped) idx file, the MNIST / Fashion-MNIST format."""
    import gzip
    import struct

    from .errors import FormatError

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4)
        if len(head) != 4 or head[:2] != b"\0\0" or head[2] != 0x08:
            raise FormatError(f"{path!r} is not an unsigned-byte idx file")
        dims = struct.unpack(f">{head[3]}I", f.read(4 * head[3]))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if data.size != int(np.prod(dims)):
        raise FormatError(f"{path!r} is truncated: {data.size} bytes for shape {dims}")
    return data.reshape(dims)


def build_fashion_mnist(src: str | None = None, out: str | None = None) -> str:
    """Build fashion-mnist-784-euclidean.hdf5 (ann-benchmarks layout) from the idx files in
    ``src`` (default: Debian's dataset-fashion-mnist); returns the output path."""
    dirs = [src] if src else list(FASHION_DIRS)
    for folder in dirs:
        tr = os.path.join(folder, "train-images-idx3-ubyte.gz")
        te = os.path.join(folder, "t10k-images-idx3-ubyte.gz")
        if os.path.exists(tr) and os.path.exists(te):
            break
    else:
        raise FileNotFoundError(
            f"Fashion-MNIST idx files not found in {dirs}: apt-get install dataset-fashion-mnist, "
            "or pass the folder holding train-images-idx3-ubyte.gz and t10k-images-idx3-ubyte.gz")
    train = read_idx(tr).reshape(-1, 784).astype(np.float32)
    test = read_idx(te).reshape(-1, 784).astype(np.float32)
    out = out or os.path.join(data_dir(), "fashion-mnist-784-euclidean.hdf5")
    write_hdf5(out, train, test, "euclidean")
    return out


def load_ann(name_or_path: str) -> dict:
    """An ann-benchmarks set by file path, or by name from the cache (built on first use for
    'fashion-mnist-784-euclidean'). Never downloads."""
    if os.path.exists(name_or_path):
        return read_hdf5(name_or_path)
    path = os.path.join(data_dir(), f"{name_or_path}.hdf5")
    if not os.path.exists(path):
        if name_or_path == "fashion-mnist-784-euclidean":
            build_fashion_mnist(out=path)
        else:
            raise FileNotFoundError(f"no dataset {name_or_path!r}: pass an ann-benchmarks .hdf5 "
                                    f"path or put it in {data_dir()}")
    return read_hdf5(path)
