"""A graph index over codes: HNSW's graph, searched through the codes of each node's neighbours.

``GraphIndex`` (``index_factory(d, "HNSW32,TQ1,Refine(Flat)")``) stores TurboQuant-mse codes
(1-4 bits) as a ``FlatIndex`` does, and a proximity graph over the rows: faiss's HNSW
(``IndexHNSWFlat``, ``M`` links per node, ``2 M`` in the base layer, ``ef_construction``),
built from the best vectors the index holds - the refinement's exact vectors, else the
refinement's or the codes' reconstructions. The graph is not kept as faiss holds it: each node's
neighbours are laid out beside it with **their codes in fast-scan blocks of 32** (and their score
terms), so expanding a node scores all its neighbours with one table-lookup pass over
contiguous bytes instead of one random read per neighbour (the layout of SymphonyQG, Gou et al.,
SIGMOD 2025). A search descends the upper layers greedily and searches the base layer best-first,
keeping the ``efSearch`` best estimates (the compiled ``graph_search``); a refinement re-ranks
the best ``k_factor * k`` of them exactly.

The layout repeats a row's codes once per node that links to it: per vector it holds
``2 M * (code bytes + 12)`` bytes (the codes, a 4-byte row number and two 4-byte score terms
per link) beside the refinement's own bytes and the adjacency (``2 M`` 4-byte neighbours) - at
1 bit and ``d = 784``, 3.5 KB for M = 16. ``memory_bytes()`` counts it. The layout sits on
2 MiB pages where Linux gives them (``tqvec.ops.pages``): a search reads it at random.

Changes: ``add`` extends the graph by faiss's HNSW insertion; faiss's index (with its own
copy of the vectors) is held only from an add to the next search, which lays the graph out and
drops it - the next add restores it from the laid-out adjacency, no rebuild. ``remove_ids``
removes rows and rebuilds the graph over the rest (HNSW has no deletion that keeps its
guarantees; the cost is a build). Filtered search (``allowed_ids``) traverses every node and
admits only allowed rows to the results, so a filter that keeps few rows costs as much as none
and may return fewer than k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codecs.base import Codec
from ..ops import pages
from .flat import FlatIndex, stored_row_terms
from .metrics import (
    METRIC_COSINE,
    METRIC_INNER_PRODUCT,
    METRIC_L2,
    metric_name,
    normalized,
    one_call_queries,
)
from .rerank import RefineLut
from .rows import Rows
from .scan import metric_terms
from .state import StoredKind, no_center_or_prefilter, register_kind, rows_state

__all__ = ["GraphIndex"]

_MAX_M = 256
_MAX_EF = 1 << 16
_ROWS = 32  # a fast-scan block
_LAYOUT_CHUNK_BYTES = 32 << 20  # neighbour rows copied at once while laying a layer out


@dataclass
class Graph:
    """HNSW's adjacency as faiss built it over rows 0..n-1: ``levels`` (n,) how many layers
    each row is in (>= 1), ``base`` (n, 2M) its base-layer neighbours, ``upper[l - 1]`` (rows in
    layer l, M) those of layer l >= 1 for the rows with levels > l in row order; -1 pads."""

    levels: np.ndarray
    base: np.ndarray
    upper: list[np.ndarray]
    entry: int

    @property
    def n(self) -> int:
        return int(self.levels.shape[0])


@dataclass
class GraphSnapshot:
    """What a graph search reads, taken together under the index's lock."""

    rows: Rows
    searcher: Any  # tqvec._C.GraphSearcher, or None without rows
    ref_lut: RefineLut | None
    arrays: list = field(default_factory=list, repr=False)  # what the searcher reads
    whole: bool = False  # the searcher runs the whole search (search_full)

    @property
    def n(self) -> int:
        return self.rows.n


def check_graph(g: Graph, n: int, M: int) -> None:
    """ValueError unless g is HNSW adjacency over n rows with M links (2 M in the base layer):
    int32 arrays of the shapes its levels imply, neighbours -1 or rows, each upper layer's
    neighbours rows of that layer, the entry a row of the top layer."""
    lv, base = g.levels, g.base
    if lv.dtype != np.int32 or lv.shape != (n,) or (n and (int(lv.min()) < 1 or
                                                        int(lv.max()) > 64)):
        raise ValueError(f"graph.levels must be ({n},) int32 in 1..64")
    if base.dtype != np.int32 or base.shape != (n, 2 * M):
        raise ValueError(f"graph.base must be ({n}, {2 * M}) int32, got {base.dtype} "
                         f"{base.shape}")
    top = int(lv.max()) if n else 1
    if len(g.upper) != top - 1:
        raise ValueError(f"the graph must have {top - 1} upper layers, got {len(g.upper)}")
    for a, layer in [(base, 0)] + [(u, i + 1) for i, u in enumerate(g.upper)]:
        rows = np.nonzero(lv > layer)[0]
        if a.dtype != np.int32 or a.shape != (len(rows), base.shape[1] if layer == 0 else M):
            raise ValueError(f"graph layer {layer} must be ({len(rows)}, "
                             f"{2 * M if layer == 0 else M}) int32, got {a.dtype} {a.shape}")
        if a.size and (int(a.min()) < -1 or int(a.max()) >= n):
            raise ValueError(f"graph layer {layer}'s neighbours must be -1 or rows < {n}")
        live = a[a >= 0]
        if layer and live.size and int(lv[live].min()) <= layer:
            raise ValueError(f"graph layer {layer}'s neighbours must be rows of that layer")
    if n and not (0 <= g.entry < n and int(lv[g.entry]) == top):
        raise ValueError(f"graph entry must be a row of the top layer, got {g.entry}")


def _padded(a: np.ndarray) -> np.ndarray:
    """Neighbour lists padded with -1 to a multiple of 32 columns (one fast-scan block each)."""
    R = -(-a.shape[1] // _ROWS) * _ROWS
    out = pages.empty((a.shape[0], R), np.int32)
    out[:, :a.shape[1]] = a
    out[:, a.shape[1]:] = -1
    return out


def _lay_out(nb: np.ndarray, packed: np.ndarray, mult: np.ndarray, add: np.ndarray, d: int,
             b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's search records for neighbour lists nb (nodes, R): each node's neighbours'
    codes in fast-scan blocks (nodes, R / 32, row bytes, 32) uint8, their multipliers and
    offsets (nodes, R) float32 (0 and -inf for padding). On huge pages (``ops.pages``: the
    search reads them at random); the codes straight from the rows' (``ops.block_code_rows``:
    no gathered copy of the neighbour rows), the scalars a chunk of nodes at a time."""
    nodes, R = nb.shape
    codes = ops.block_code_rows(torch.from_numpy(packed), torch.from_numpy(nb.reshape(-1)), d,
                                b).numpy().reshape(nodes, R // _ROWS,
                                                   ops.fast_scan_row_bytes(d, b), _ROWS)
    em = pages.empty((nodes, R), np.float32)
    ea = pages.empty((nodes, R), np.float32)
    step = max(1, _LAYOUT_CHUNK_BYTES // max(1, R * 8))
    for i in range(0, nodes, step):
        part = nb[i:i + step]
        live = part >= 0
        r = np.where(live, part, 0)
        em[i:i + step] = np.where(live, mult[r], 0.0)
        ea[i:i + step] = np.where(live, add[r], -np.inf)
    return codes, em, ea


class GraphIndex(FlatIndex):
    """HNSW graph search over TurboQuant-mse codes with the neighbours' codes beside each node.

    Parameters
    ----------
    codec: ``TurboQuant`` (variant ``"mse"``) at 1-4 bits.
    M: links per node (faiss's ``HNSW{M}``; the base layer has 2 M).
    metric, refine, k_factor: as in ``FlatIndex`` (``refine="flat"`` or a finer codec re-ranks
        the candidates; without one the graph's estimates are the results).
    efSearch: candidates kept by the base-layer search (an attribute, as faiss's
        ``hnsw.efSearch``; at least the candidates the re-rank takes are kept).
    ef_construction: faiss's ``efConstruction`` of the build (default 200, hnswlib's: faiss's
        own 40 builds a graph that needs a larger efSearch for the same recall).
        The build is faiss's HNSW insertion, most of this index's cost (docs/search.md gives
        it); ``verbose`` shows its progress.
    verbose: print the build's progress (faiss's own, per level) and the search layout's
        making (the first search after adds or a read) to stdout, as faiss's ``verbose``.
    """

    def __init__(self, codec: Codec, M: int = 32, metric: Any = "l2", *,
                 refine: Codec | str | None = None, k_factor: int = 4, efSearch: int = 64,
                 ef_construction: int = 200, verbose: bool = False):
        form = codec.kernel_form() if isinstance(codec, Codec) else None
        if form is None or form.bits not in ops.FAST_SCAN_BITS:
            raise ValueError(f"codec must be TurboQuant-mse at {list(ops.FAST_SCAN_BITS)} bits "
                             f"(or another codec whose kernel_form() is one rotated-domain "
                             f"term of those widths) for a graph index (its neighbours' codes "
                             f"are fast-scanned), got {codec!r}")
        if not ops.has_cpu_kernels():
            raise ValueError("a graph index needs the compiled CPU kernels (tqvec._C), which "
                             "this install lacks")
        super().__init__(codec, metric, refine=refine, k_factor=k_factor)
        self.M = V.positive_int(M, "M", 2, _MAX_M)
        self.ef_construction = V.positive_int(ef_construction, "ef_construction", 1, _MAX_EF)
        self.efSearch = efSearch
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, got {verbose!r:.40}")
        self.verbose = verbose
        # faiss's IndexHNSWFlat over rows 0..n-1 while rows are added; dropped once a search has
        # laid the graph out (its copy of the vectors is then 4 d bytes per row the search never
        # reads) and restored from that graph by the next add
        self._hnsw: Any = None
        self._graph: Graph | None = None

    # -- parameters ----------------------------------------------------------------------------
    @property
    def efSearch(self) -> int:
        return self._ef

    @efSearch.setter
    def efSearch(self, value: int) -> None:
        self._ef = V.positive_int(value, "efSearch", 1, _MAX_EF)

    @property
    def prefilter(self) -> int:
        """0: a graph index has no first pass (its traversal is one)."""
        return 0

    @prefilter.setter
    def prefilter(self, value: int) -> None:
        if V.positive_int(value, "prefilter", 0, V.MAX_CANDIDATE_FACTOR):
            raise ValueError(f"prefilter must be 0 for a graph index, got {value!r}")
        self._prefilter = 0

    @property
    def prefilter_sigmas(self) -> float:
        """0: a graph index has no first pass."""
        return 0.0

    @prefilter_sigmas.setter
    def prefilter_sigmas(self, value: float) -> None:
        if V.finite_float(value, "prefilter_sigmas"):
            raise ValueError(f"prefilter_sigmas must be 0 for a graph index, got {value!r}")

    # -- the graph -----------------------------------------------------------------------------
    def _graph_vectors(self, t: torch.Tensor) -> np.ndarray:
        """The vectors the graph links (float32, numpy) of new stored rows t: the rows
        themselves (unit rows for cosine). A graph rebuilt later (after a removal, or to extend
        one read from a file) links what the index still holds (``_stored_vectors``)."""
        x = t.to(torch.float32).cpu()
        if self.metric_type == METRIC_COSINE and not self.centered:
            x = normalized(x)
        return np.ascontiguousarray(x.numpy())

    def _faiss_graph(self) -> Any:
        import faiss
        metric = (faiss.METRIC_INNER_PRODUCT if self._scoring == METRIC_INNER_PRODUCT
                  else faiss.METRIC_L2)
        h = faiss.IndexHNSWFlat(self.d, self.M, metric)
        h.hnsw.efConstruction = self.ef_construction
        h.verbose = self.verbose
        return h

    def _append(self, t: torch.Tensor, ids: torch.Tensor | None) -> None:
        if t.shape[0] == 0:
            return
        self._check_ready("add")
        codes, ref, per_row = self._encode(t)
        x = self._graph_vectors(self._to_stored(t))
        with self._lock:
            if self._hnsw is None:
                self._hnsw = self._faiss_graph()
                if self._rows.n:  # the graph laid out (or read from a file): faiss's again
                    self._restore_builder(self._hnsw, self._graph_now())
            self._hnsw.add(x)
            self._rows.append(codes, self._next_ids(t.shape[0]) if ids is None else ids, ref,
                              per_row)
            self._graph = None
            self._invalidate()

    def _stored_vectors(self, rows: Rows) -> np.ndarray:
        """Every stored row as the graph links it: the refinement's exact vectors, else the
        refinement's or the codes' reconstruction."""
        if self.refine == "flat" and rows.ref is not None:
            x = rows.ref
        elif isinstance(self.refine, Codec) and rows.ref is not None:
            x = torch.as_tensor(self.refine.decode(rows.ref, like=np.empty(0)))
        else:
            x = torch.as_tensor(self.codec.decode(rows.codes_rows(0, rows.n),
                                                  like=np.empty(0)))
        if self.metric_type == METRIC_COSINE and not self.centered:
            x = normalized(x.to(torch.float32))
        return np.ascontiguousarray(x.to(torch.float32).numpy())

    def _removed(self) -> None:
        super()._removed()
        # HNSW has no deletion: a graph over the remaining rows
        self._hnsw = None
        self._graph = None
        if self._rows.n:
            self._hnsw = self._faiss_graph()
            self._hnsw.add(self._stored_vectors(self._rows))

    def _restore_builder(self, h: Any, g: Graph) -> None:
        """faiss's HNSW index h (empty) holding graph g over the stored rows again: their
        vectors (``_stored_vectors``) and g's adjacency in faiss's arrays (levels, per-row
        offsets, neighbours by level), so that adds extend g instead of a new build."""
        import faiss
        hn = h.hnsw
        cum = faiss.vector_to_array(hn.cum_nneighbor_per_level).astype(np.int64)
        top = int(g.levels.max())
        if top + 1 > len(cum):
            raise ValueError(f"the graph has {top} layers, more than faiss's HNSW allows")
        per_row = cum[g.levels]
        offsets = np.zeros(g.n + 1, dtype=np.uint64)
        offsets[1:] = np.cumsum(per_row)
        nbrs = np.full(int(offsets[-1]), -1, dtype=np.int32)
        start = offsets[:-1].astype(np.int64)
        nbrs[(start[:, None] + np.arange(cum[0], cum[1])[None, :]).reshape(-1)] = \
            g.base.reshape(-1)
        for lv, nb in enumerate(g.upper, start=1):
            rows = np.nonzero(g.levels > lv)[0]
            nbrs[(start[rows, None] + np.arange(cum[lv], cum[lv + 1])[None, :]).reshape(-1)] = \
                nb.reshape(-1)
        h.storage.add(self._stored_vectors(self._rows))
        faiss.copy_array_to_vector(g.levels.astype(np.int32), hn.levels)
        faiss.copy_array_to_vector(offsets, hn.offsets)
        faiss.copy_array_to_vector(nbrs, hn.neighbors)
        hn.entry_point = g.entry
        hn.max_level = top - 1
        h.ntotal = g.n

    def _graph_now(self) -> Graph:
        """The adjacency of faiss's graph over the current rows (lock held)."""
        if self._graph is not None:
            return self._graph
        import faiss
        h = self._hnsw.hnsw
        levels = faiss.vector_to_array(h.levels).astype(np.int32)
        offsets = faiss.vector_to_array(h.offsets).astype(np.int64)
        nbrs = faiss.vector_to_array(h.neighbors).astype(np.int32)
        cum = faiss.vector_to_array(h.cum_nneighbor_per_level).astype(np.int64)
        n = levels.shape[0]
        base = nbrs[offsets[:n, None] + np.arange(cum[0], cum[1])[None, :]]
        upper = []
        for lv in range(1, int(levels.max())):
            rows = np.nonzero(levels > lv)[0]
            upper.append(nbrs[offsets[rows, None] + np.arange(cum[lv], cum[lv + 1])[None, :]])
        self._graph = Graph(levels, base, upper, int(h.entry_point))
        return self._graph

    # -- the search state ------------------------------------------------------------------------
    def _snapshot(self) -> GraphSnapshot:
        rows = self._rows
        if rows.n == 0:
            return GraphSnapshot(rows.snapshot(), None, self._refine_lut())
        rows.materialize()
        g = self._graph_now()
        if self.verbose:
            print(f"GraphIndex: laying out {rows.n:,} nodes' neighbour codes for search",
                  flush=True)
        term = self.codec.lut_terms(rows.codes)[0]
        (mult,), add = metric_terms([term], rows.n, self._scoring, rows.term("sqnorms"),
                                    rows.term("ipcorr"), self.device)
        mult, add, packed = mult.numpy(), add.numpy(), term.packed.numpy()
        layers = [(_padded(g.base), None)]
        for lv, nb in enumerate(g.upper, start=1):
            slot = np.full(rows.n, -1, dtype=np.int32)
            slot[np.nonzero(g.levels > lv)[0]] = np.arange(nb.shape[0], dtype=np.int32)
            layers.append((_padded(nb), slot))
        arrays = {"neighbours": [], "codes": [], "mult": [], "add": [], "slots": []}
        for nb, slot in layers:
            codes, em, ea = _lay_out(nb, packed, mult, add, term.d, term.bits)
            arrays["neighbours"].append(nb)
            arrays["codes"].append(codes)
            arrays["mult"].append(em)
            arrays["add"].append(ea)
            arrays["slots"].append(np.empty(0, np.int32) if slot is None else slot)
        # the entry's own code, a one-node layer whose one neighbour is the entry
        one = np.full((1, _ROWS), -1, dtype=np.int32)
        one[0, 0] = g.entry
        entry = dict(zip(("entry_codes", "entry_mult", "entry_add"),
                         _lay_out(one, packed, mult, add, term.d, term.bits), strict=True))
        # the whole search in one call where the rotation runs on the compiled kernel, with
        # exact vectors or no refinement (finer codes re-rank through the composition)
        rotate = self.codec.query_rotation() if self.refine in (None, "flat") else None
        args = ops.GraphSearchArgs(
            arrays, entry, rows.n, term.d, term.bits, term.centroids, g.entry, rotate,
            rows.ids.numpy(), metric_name(self._scoring), self.metric_type == METRIC_COSINE,
            rows.ref.numpy() if self.refine == "flat" and rotate is not None else None)
        kernel = ops.prepare("graph_search", args, torch.device("cpu"), "cpu")
        self._hnsw = None  # the adjacency is in self._graph; an add restores faiss's index
        return GraphSnapshot(rows.snapshot(), kernel.searcher, self._refine_lut(),
                             [*arrays.values(), list(entry.values())], kernel.whole)

    def _fused_search(self, x: Any, snap: GraphSnapshot, k: int
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """float32 numpy queries through the searcher's whole search (rotation, graph, exact
        re-rank, ids), where it has one; None otherwise and for queries holding NaN or Inf
        (the composition reports them)."""
        if not (snap.whole and one_call_queries(x, self.d, max_rows=None)):
            return None
        # with exact vectors the search keeps the k best it expanded, exactly scored
        kk = min(k, snap.n) if self.refine == "flat" else self._candidates(snap.n, k)
        q = np.ascontiguousarray(x)
        D = np.empty((q.shape[0], k), dtype=np.float32)
        I = np.empty((q.shape[0], k), dtype=np.int64)
        if not snap.searcher.search_full(q, kk, max(self._ef, kk), D, I, ops.threads()):
            return None
        return D, I

    def _candidates(self, n: int, k: int) -> int:
        """Candidates the graph returns per query for the re-rank (k_factor k, as faiss's
        ``IndexRefine``), or k without a refinement; the search keeps at least that many."""
        return min(n, k * self._k_factor if self.refine is not None else k)

    def _scan_block(self, q: torch.Tensor, snap: GraphSnapshot, mask: torch.Tensor | None,
                    kk: int, nq_total: int,
                    route: tuple[int, int] | None = None, probes: Any = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        qr = self.codec.query_terms(q)[0].to(torch.float32).contiguous()
        nq = q.shape[0]
        vals = np.empty((nq, kk), dtype=np.float32)
        pos = np.empty((nq, kk), dtype=np.int64)
        allowed = None if mask is None else mask.to(torch.uint8).cpu().numpy()
        qsq = ops.row_sqnorms(q).cpu().numpy() if self._scoring == METRIC_L2 else None
        if snap.whole and self.refine == "flat":
            # the expanded nodes' exact similarities (what the re-rank then recomputes)
            qn = np.ascontiguousarray(q.cpu().numpy(), dtype=np.float32)
            snap.searcher.search(qr.numpy(), max(self._ef, kk), vals, pos, ops.threads(),
                                 allowed, qn, qsq)
            return vals, pos
        snap.searcher.search(qr.numpy(), max(self._ef, kk), vals, pos, ops.threads(), allowed)
        if qsq is not None:
            vals = vals - qsq[:, None]
        return vals, pos

    def memory_bytes(self) -> int:
        """``FlatIndex.memory_bytes`` (the search layout and adjacency included, once a search
        built them) plus faiss's index while it is held (from an add to the next search): its
        copy of the vectors and its links."""
        held = super().memory_bytes()
        h = self._hnsw
        if h is not None:
            import faiss
            g = h.hnsw
            held += h.ntotal * self.d * 4 + sum(
                faiss.vector_to_array(a).nbytes for a in (g.neighbors, g.offsets, g.levels))
        return held

    # -- state (files) -----------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta, arrays) as ``tqvec.index.io`` writes them: the flat index's, and the graph's
        adjacency (``graph.levels``, ``graph.base``, ``graph.upper``; the laid-out codes are
        derived again when the file is read, and an add after reading extends the graph)."""
        with self._lock:
            rows = self._rows.snapshot()
            graph = self._graph_now() if rows.n else None
        meta, arrays = rows_state(self, rows, "graph", **self._state_meta(), M=self.M,
                                  efSearch=self.efSearch, ef_construction=self.ef_construction,
                                  entry=-1 if graph is None else graph.entry)
        if graph is not None:
            arrays["graph.levels"] = graph.levels
            arrays["graph.base"] = graph.base
            # the upper layers' rows one after another (layer 1's, then 2's ...): their sizes
            # follow from the levels
            arrays["graph.upper"] = (np.concatenate(graph.upper) if graph.upper
                                     else np.zeros((0, self.M), np.int32))
        return meta, arrays

    def install_graph(self, graph: Graph | None) -> None:
        """Take over a graph read from a file (``index_from_state``), checked against the rows
        (ValueError where it does not fit them); a later ``add`` extends it."""
        n = self._rows.n
        if graph is None:
            if n:
                raise ValueError(f"a graph index of {n} rows must hold its graph")
            return
        check_graph(graph, n, self.M)
        with self._lock:
            self._graph = graph
            self._hnsw = None
            self._snap = None

    def __repr__(self) -> str:
        ref = f", refine={self.refine!r}" if self.refine is not None else ""
        return (f"GraphIndex({self.codec!r}, M={self.M}, metric="
                f"{metric_name(self.metric_type)!r}{ref}, efSearch={self._ef}, "
                f"ntotal={self._rows.n})")


# -- files: the graph index's part of tqvec.index.state -----------------------------------------

def _empty_from_state(meta: dict, codec: Codec, refine: Any, arrays: dict) -> GraphIndex:
    no_center_or_prefilter(meta, "a graph index")
    return GraphIndex(codec, meta["M"], meta["metric"], refine=refine, k_factor=meta["k_factor"],
                      efSearch=meta["efSearch"], ef_construction=meta["ef_construction"])


def _arrays_in_state(meta: dict, ntotal: int) -> tuple[set[str], set[str]]:
    return ({"graph.levels", "graph.base", "graph.upper"} if ntotal else set()), set()


def _graph_from_state(index: GraphIndex, meta: dict, arrays: dict, ntotal: int) -> None:
    """Install the stored graph (checked by ``GraphIndex.install_graph``; none for no rows)."""
    if not ntotal:
        index.install_graph(None)
        return
    levels, base, upper = arrays["graph.levels"], arrays["graph.base"], arrays["graph.upper"]
    if levels.dtype != np.int32 or levels.shape != (ntotal,) or int(levels.min()) < 1 or \
            int(levels.max()) > 64:
        raise ValueError(f"graph.levels must be ({ntotal},) int32 in 1..64")
    sizes = [int((levels > lv).sum()) for lv in range(1, int(levels.max()))]
    if upper.ndim != 2 or upper.shape[0] != sum(sizes):
        raise ValueError(f"graph.upper must have {sum(sizes)} rows, got shape {upper.shape}")
    parts = np.split(np.asarray(upper), np.cumsum(sizes)[:-1]) if sizes else []
    entry = V.positive_int(meta["entry"], "entry", 0, ntotal - 1)
    index.install_graph(Graph(np.asarray(levels), np.asarray(base), list(parts), entry))


register_kind("graph", StoredKind(
    GraphIndex, meta=frozenset({"M", "efSearch", "ef_construction", "entry"}),
    not_per_row=frozenset({"graph.upper"}), empty=_empty_from_state, arrays=_arrays_in_state,
    per_row=stored_row_terms, finish=_graph_from_state, what="graph"))
