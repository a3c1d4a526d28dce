"""tqvec as an ann-benchmarks algorithm (copy this folder to ann_benchmarks/algorithms/tqvec/).

Build arguments: ``metric`` (ann-benchmarks passes 'euclidean' or 'angular'), ``spec`` (a
``tqvec.index_factory`` string, e.g. "TQ4" or "TQ2,Refine(TQ8)"). Query arguments:
``k_factor`` (candidates per result re-ranked by a ``Refine(...)`` stage; ignored without one).
``fit`` encodes the base set; it trains first only where the spec asks for a fit
("Center,": the mean; "PCA,": the mean and principal components).
"""

from __future__ import annotations

import numpy as np

try:  # inside ann-benchmarks
    from ..base.module import BaseANN
except ImportError:  # our own runner (bench/ann_benchmarks/run.py): the same interface
    class BaseANN:  # minimal stand-in for ann_benchmarks.algorithms.base.module.BaseANN
        def done(self) -> None:
            pass

        def get_memory_usage(self) -> float:
            import psutil
            return psutil.Process().memory_info().rss / 1024

        def get_additional(self) -> dict:
            return {}

        def __str__(self) -> str:
            return self.name

import tqvec

_METRICS = {"euclidean": "l2", "angular": "cosine", "dot": "ip", "ip": "ip"}


class TQVec(BaseANN):
    def __init__(self, metric: str, spec: str):
        if metric not in _METRICS:
            raise ValueError(f"metric must be one of {sorted(_METRICS)}, got {metric!r}")
        self._metric = _METRICS[metric]
        self._spec = spec
        self.index = None
        self.name = f"tqvec({spec})"

    def fit(self, X: np.ndarray) -> None:
        X = np.ascontiguousarray(X, dtype=np.float32)
        self.index = tqvec.index_factory(X.shape[1], self._spec, self._metric)
        if not self.index.is_trained:  # "Center," / "PCA,": fitted on the base set
            self.index.train(X)
        self.index.add(X)

    def set_query_arguments(self, *args: int) -> None:
        """``Refine`` specs: (k_factor[, prefilter]); other specs: (prefilter,) - candidates
        per result of the sign-bit first pass (``FlatIndex.prefilter``, 0 = exact scan)."""
        refine = "Refine" in self._spec
        names = ("k_factor", "prefilter") if refine else ("prefilter",)
        if len(args) > len(names):
            raise ValueError(f"query arguments must be {names} for {self._spec!r}, got {args}")
        parts = [self._spec]
        for name, value in zip(names[:len(args)], args, strict=True):
            setattr(self.index, name, int(value))
            parts.append(f"{name}={int(value)}")
        self.name = f"tqvec({','.join(parts)})"

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        _, I = self.index.search(np.asarray(v, dtype=np.float32)[None, :], n)
        return I[0][I[0] >= 0]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        _, I = self.index.search(np.ascontiguousarray(X, dtype=np.float32), n)
        self.res = I

    def get_batch_results(self) -> np.ndarray:
        return self.res

    def get_memory_usage(self) -> float:
        """Kilobytes held by the index (codes + side information), not the process RSS."""
        if self.index is None:
            return 0.0
        return self.index.ntotal * self.index.code_size / 1024

    def __str__(self) -> str:
        return self.name
