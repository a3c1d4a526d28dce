"""Dataset loaders. The embedded default needs no download: scikit-learn's bundled digits
(1,797 real 8x8 handwritten digits, 64-d, pixel values 0..16), which ships inside the
scikit-learn wheel. Larger real sets (Fashion-MNIST, MiniLM embeddings) come as ann-benchmarks
HDF5 files built by the recipes in ``datasets/``."""

from __future__ import annotations

import numpy as np

__all__ = ["EMBEDDED", "load_embedded", "split_queries"]

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
                              "scikit-learn") from e
        return load_digits().data.astype(np.float32)
    if name == "random":
        return np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    raise ValueError(f"dataset must be one of {list(EMBEDDED)}, got {name!r}")


def split_queries(x: np.ndarray, nq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``nq`` random rows as queries: returns ``(base, queries)``."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(x))
    return x[perm[nq:]], x[perm[:nq]]
