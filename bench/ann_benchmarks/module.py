"""tqvec as an ann-benchmarks algorithm (``install.sh`` copies this folder to
ann_benchmarks/algorithms/tqvec/ of a harness checkout).

Build arguments: ``metric`` (the harness passes 'euclidean' or 'angular'), ``spec``, a
``tqvec.index_factory`` string ("TQ4", "Center,TQ2f", "IVF256,TQ1,Refine(Flat)", ...), and for
a graph index (``HNSW{M},...``) optionally ``ef_construction`` (the build's efConstruction;
default 200).
``fit`` trains where the spec asks for a fit ("Center,": the mean; "PCA,": the mean and
principal components; "IVF...": k-means), adds the base set and builds the search layouts.

Query arguments, by the kind of index (positional, as the harness passes them):

- ``IVF{n},...``: ``(nprobe[, k_factor])`` - lists searched, and with a ``Refine(...)`` stage
  the candidates per result it re-ranks;
- ``HNSW{M},...`` (the graph index): ``(efSearch,)`` - candidates its search keeps;
- flat with ``Refine(...)``: ``(k_factor[, prefilter])``;
- other flat indexes: ``(prefilter,)`` - candidates per result of the sign-bit first pass
  (``FlatIndex.prefilter``; 0 = exact scan).
"""

from __future__ import annotations

import numpy as np

try:  # inside ann-benchmarks
    from ..base.module import BaseANN
except ImportError:  # our own runner (bench/ann_benchmarks/run.py): the same interface
    class BaseANN:  # minimal stand-in for ann_benchmarks.algorithms.base.module.BaseANN
        def done(self) -> None:
            pass

        def get_additional(self) -> dict:
            return {}

        def __str__(self) -> str:
            return self.name

import tqvec

_METRICS = {"euclidean": "l2", "angular": "cosine", "dot": "ip", "ip": "ip"}


class TQVec(BaseANN):
    def __init__(self, metric: str, spec: str, ef_construction: int | None = None):
        if metric not in _METRICS:
            raise ValueError(f"metric must be one of {sorted(_METRICS)}, got {metric!r}")
        if ef_construction is not None and not spec.startswith("HNSW"):
            raise ValueError(f"ef_construction is a graph index's build parameter, got it with "
                             f"{spec!r}")
        self._metric = _METRICS[metric]
        self._spec = spec
        self._ef_construction = ef_construction
        self.index = None
        self.res: list[np.ndarray] = []
        self.name = f"tqvec({spec})"

    def fit(self, X: np.ndarray) -> None:
        X = np.ascontiguousarray(X, dtype=np.float32)
        self.index = tqvec.index_factory(X.shape[1], self._spec, self._metric)
        if self._ef_construction is not None:
            self.index.ef_construction = int(self._ef_construction)
        if not self.index.is_trained:  # Center, PCA, IVF: fitted on the base set
            self.index.train(X)
        self.index.add(X)
        self.index.search(X[:1], 1)  # the search layouts, built now: not in the first query

    def _query_names(self) -> tuple[str, ...]:
        refine = "Refine" in self._spec
        if self._spec.startswith("HNSW"):
            return ("efSearch",)
        if self._spec.startswith("IVF") or ",IVF" in self._spec:
            return ("nprobe", "k_factor") if refine else ("nprobe",)
        return ("k_factor", "prefilter") if refine else ("prefilter",)

    def set_query_arguments(self, *args: int) -> None:
        names = self._query_names()
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
        # faiss's -1 padding (fewer than n results) is not a result: the harness would read it
        # as a duplicated candidate
        self.res = [row[row >= 0] for row in I]

    def get_batch_results(self) -> list[np.ndarray]:
        return self.res

    def get_memory_usage(self) -> float:
        """Kilobytes the index holds (``memory_bytes``): codes, ids, per-vector scalars and
        derived terms, the search layouts (built in ``fit``), the codec's rotation and
        codebooks, and what was trained (centre, PCA basis, IVF centroids); 0 before ``fit``.
        Not the process's RSS: the harness runs every algorithm of a ``--local`` run in one
        process, so RSS differences would mix in the allocator's and other runs' memory."""
        if self.index is None:
            return 0.0
        return self.index.memory_bytes() / 1024

    def done(self) -> None:
        self.index = None
        self.res = []

    def __str__(self) -> str:
        return self.name
