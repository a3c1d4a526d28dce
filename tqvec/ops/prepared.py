"""Prepared ops: an op's fixed arguments (codes, centroids, a rotation's parameters) held in one
struct, its implementation chosen once by ``dispatch.pick`` from the table's row for it.

Each prepared row of ``dispatch.OPS`` maps a struct to a runner: the reference (``prepared_ref``:
the per-call reference ops over the struct's tensors), the compiled CPU kernel
(``prepared_cpu``: the kernel over numpy views made once) and, where written, a CUDA kernel. A
search then pays only for its queries: a one-query search on the compiled kernel is one call
(per-call dispatch and conversions cost as much as a small scan). A kernel that cannot take a
struct (another dtype, say) returns no runner and the struct runs the reference.

The fused rows (``flat_search_fused``, ``terms_search_fused``, ``ivf_search_fused``,
``graph_search``) map an index's prepared parts to one compiled call for its whole search; their
reference is "none": the index composes the parts, which is what the fused call computes, bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .dispatch import OPS, pick
from .ref import FAST_SCAN_BITS, SignBound, check_sign_bound

__all__ = ["prepare", "HadamardRotate", "ScanTerm", "FullCodes", "FastScan", "IVFFastScan",
           "IVFProbe", "ScanSearchArgs", "FlatSearchArgs", "TermsSearchArgs", "IVFSearchArgs",
           "GraphSearchArgs", "CodeRefinement", "MAX_SCAN_TERMS"]

#: Code terms one fast scan sums per row (csrc/cpu/fastscan/terms.h kMaxTerms).
MAX_SCAN_TERMS = 8


def prepare(name: str, args: Any, device: torch.device, backend: str) -> Any:
    """The runner of prepared row ``name`` for ``args`` on ``device`` under ``backend``: the
    implementation ``pick`` chooses, or the reference where that kernel takes no such struct
    (a fused row's reference gives None: no fused form)."""
    impl = pick(name, device, backend)
    run = impl(args)
    if run is None and impl is not OPS[name].ref:
        run = OPS[name].ref(args)
    return run


class HadamardRotate:
    """``hadamard_rotate`` with fixed permutations and signs (on one device), prepared once:
    ``rotate(x)`` / ``rotate(x, inverse=True)``. ``compiled``: the compiled CPU kernel runs it
    (then float32 CPU rows are one kernel call)."""

    def __init__(self, perms: torch.Tensor, signs: torch.Tensor, p: int, backend: str = "auto"):
        self.perms, self.signs = perms.contiguous(), signs.contiguous()
        self.p, self.backend = int(p), backend
        self.device = self.perms.device
        self.runner = prepare("hadamard_rotate_prepared", self, self.device, backend)
        self.compiled = getattr(self.runner, "compiled", False)

    def __call__(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if x.device != self.device:
            raise ValueError(f"x must be on the rotation's device {self.device}, got {x.device}")
        return self.runner(x, bool(inverse))


@dataclass(frozen=True)
class ScanTerm:
    """One code term of a fast scan: the codes in the fast-scan layout (``block_codes``), the
    centroids (2^bits,) float32, per-row multipliers (n,) float32, and where a two-stage scan
    over several terms re-scores from them, the row-major packed codes (n, ceil(d bits / 8))."""

    blocked: torch.Tensor
    centroids: torch.Tensor
    mult: torch.Tensor
    bits: int
    packed: torch.Tensor | None = None


@dataclass(frozen=True)
class FullCodes:
    """A two-stage scan's second stage behind a one-term sign pass: the full ``bits``-bit codes
    (``packed`` rows, their ``centroids``) that re-score the pass's k1 best rows; the pass's own
    row offsets ``first_add`` (default the scan's) and multipliers ``first_mult`` (default its
    term's). ``bound`` (a ``SignBound``): the pass keeps the rows whose error bound reaches the
    k-th best instead of k1 (``fast_scan_two_stage``'s bound: the pass's terms then estimate the
    full codes' scores)."""

    packed: torch.Tensor
    bits: int
    centroids: torch.Tensor
    first_add: torch.Tensor | None = None
    first_mult: torch.Tensor | None = None
    bound: SignBound | None = None


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


class FastScan:
    """``fast_scan_terms`` over fixed codes, prepared once: score_i = add_i +
    sum_t mult_t,i <qr_t, centroids_t[idx_t,i]> over ``terms`` (1 to 8 ``ScanTerm``s), the top
    k exactly (a shortlist provably sufficient for the 8-bit tables, re-scored exactly). The
    index keeps one per state of its rows; the arrays must not change while it is in use.

    Two stages, a heuristic (a row outside the first pass's k1 best is never scored):
    ``full=FullCodes(...)`` behind one 1-bit term (the codes' sign plane;
    ``fast_scan_two_stage``), or ``first=f`` over several terms that each carry ``packed``
    codes: the k1 best rows by the first f terms, re-scored with every term
    (``fast_scan_terms_two_stage``).

    ``search(qrs, k, add=None, k1=None, approx=False) -> (vals, pos)``: ``add`` replaces the
    offsets for one search (e.g. -inf outside an allowed set); ``approx=True`` lets the compiled
    one-term kernel rank by its 8-bit tables and return those scores (for a first stage that a
    refinement re-ranks); elsewhere it is exact. Query terms are tensors, or, where the compiled
    kernel holds the scan (``compiled``), float32 numpy arrays, which reach it without a
    conversion per term."""

    def __init__(self, terms: list[ScanTerm], n: int, add: torch.Tensor, backend: str = "auto",
                 *, full: FullCodes | None = None, first: int = 0):
        if not 1 <= len(terms) <= MAX_SCAN_TERMS:
            raise ValueError(f"terms must hold 1 to {MAX_SCAN_TERMS} scan terms, got "
                             f"{len(terms)}")
        for t in terms:
            if t.bits not in FAST_SCAN_BITS:
                raise ValueError(f"a scan term's bits must be in {list(FAST_SCAN_BITS)}, got "
                                 f"{t.bits}")
        if full is not None and [t.bits for t in terms] != [1]:
            raise ValueError(f"a two-stage scan needs one 1-bit term (the signs), got bits "
                             f"{[t.bits for t in terms]}")
        self.first = int(first)
        if self.first and not (1 <= self.first <= len(terms) and full is None
                               and all(t.packed is not None for t in terms)):
            raise ValueError(f"first must be 0, or 1 to {len(terms)} (the terms) with packed "
                             f"codes for every term, got first={first}")
        self.terms = [ScanTerm(t.blocked.contiguous(), t.centroids.contiguous(),
                               t.mult.contiguous(), int(t.bits),
                               _contiguous(t.packed) if self.first else None) for t in terms]
        self.n, self.backend = int(n), backend
        self.bits = [t.bits for t in self.terms]
        self.add = add.contiguous()
        self.full = None if full is None else FullCodes(
            full.packed.contiguous(), int(full.bits), full.centroids.contiguous(),
            self.add if full.first_add is None else full.first_add.contiguous(),
            _contiguous(full.first_mult), check_sign_bound(full.bound))
        self.device = self.add.device
        self.runner = prepare("fast_scan_prepared", self, self.device, backend)
        self.compiled = getattr(self.runner, "compiled", False)

    def search(self, qrs: list[torch.Tensor] | list[np.ndarray], k: int,
               add: torch.Tensor | None = None, k1: int | None = None, approx: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(qrs) != len(self.terms):
            raise ValueError(f"qrs must hold {len(self.terms)} query terms, got {len(qrs)}")
        if isinstance(qrs[0], np.ndarray) and not self.compiled:
            raise TypeError("qrs must be torch tensors where the compiled CPU kernel does not "
                            "hold the scan, got numpy arrays")
        if self.full is not None and self.full.bound is not None:
            k1 = k1 or 1  # the bound selects the rows
        if (self.full is not None or self.first) and (k1 is None or k1 < 1):
            raise ValueError(f"k1 must be a positive int for a two-stage scan, got {k1!r}")
        if k1 is not None:
            k1 = min(int(k1), max(self.n, 1))  # more candidates than rows: every row
        add1 = None
        if add is not None:
            add = add.contiguous()
            if self.full is not None:  # an override excludes its -inf rows from the first pass
                add1 = torch.where(torch.isinf(add) & (add < 0), add, self.full.first_add)
        return self.runner(qrs, int(k), add, add1, k1, bool(approx))


class IVFFastScan:
    """``ivf_fast_scan`` over fixed inverted lists, prepared once like ``FastScan``:
    ``search(qr, probes, offsets, k, add=None, approx=False) -> (vals, pos)`` takes and returns
    numpy arrays (float32 qr, int64 probes, float32 offsets) — the IVF index computes its probes
    in numpy —, ``add`` replaces the prepared row offsets for one search, ``approx`` as in
    ``ivf_fast_scan``."""

    def __init__(self, blocked: torch.Tensor, centroids: torch.Tensor, mult: torch.Tensor,
                 add: torch.Tensor, list_blocks: torch.Tensor, b: int, backend: str = "auto"):
        if b not in FAST_SCAN_BITS:
            raise ValueError(f"b must be one of {list(FAST_SCAN_BITS)} for ivf_fast_scan, "
                             f"got {b}")
        self.blocked, self.centroids = blocked.contiguous(), centroids.float().contiguous()
        self.mult, self.add = mult.float().contiguous(), add.float().contiguous()
        self.list_blocks = list_blocks.to(torch.int64).contiguous()
        self.b, self.backend = int(b), backend
        self.device = self.add.device
        self.runner = prepare("ivf_fast_scan_prepared", self, self.device, backend)
        self.compiled = getattr(self.runner, "compiled", False)

    def search(self, qr: np.ndarray, probes: np.ndarray, offsets: np.ndarray, k: int,
               add: torch.Tensor | None = None, approx: bool = False
               ) -> tuple[np.ndarray, np.ndarray]:
        return self.runner(np.ascontiguousarray(qr, np.float32),
                           np.ascontiguousarray(probes, np.int64),
                           np.ascontiguousarray(offsets, np.float32), int(k),
                           None if add is None else add.float().contiguous(), bool(approx))


class IVFProbe:
    """``ivf_probe`` against fixed centroids, prepared once: ``probe(q, nprobe) -> (probes,
    scores)`` on float32 numpy queries, each query's nprobe best lists, best first."""

    def __init__(self, centroids: torch.Tensor, csq: torch.Tensor, l2: bool,
                 backend: str = "auto"):
        self.centroids = centroids.to(torch.float32).contiguous()
        self.csq = csq.to(torch.float32).contiguous()
        self.l2, self.backend = bool(l2), backend
        self.device = self.centroids.device
        self.runner = prepare("ivf_probe_prepared", self, self.device, backend)
        self.compiled = getattr(self.runner, "compiled", False)

    def probe(self, q: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        nlist = self.centroids.shape[0]
        if not 1 <= nprobe <= nlist:
            raise ValueError(f"nprobe must be in 1..{nlist}, got {nprobe}")
        return self.runner(np.ascontiguousarray(q, np.float32), int(nprobe))


@dataclass(frozen=True)
class CodeRefinement:
    """Finer TurboQuant-mse codes that re-score a fused search's candidates (``lut_rescore``):
    their query rotation, packed rows, bits, centroids, multipliers and offsets."""

    rotate: HadamardRotate
    packed: Any
    bits: int
    centroids: Any
    mult: Any
    add: Any


@dataclass(frozen=True)
class ScanSearchArgs:
    """What a whole search over one fast scan shares: the queries minus ``center`` or to unit
    norm (``normalize``) before the index's query step, ``scan`` (two stages with
    ``prefilter``), for l2 the score minus the queries' squared norms, then the ids and
    distances as faiss returns them (plus ``row_dots(q, ip_center)`` where given)."""

    scan: FastScan
    ids: np.ndarray
    metric: str
    prefilter: int = 0
    center: np.ndarray | None = None
    normalize: bool = False
    ip_center: np.ndarray | None = None


@dataclass(frozen=True, kw_only=True)
class FlatSearchArgs(ScanSearchArgs):
    """A whole flat search (row ``flat_search_fused``): the query step ``rotate``, the scan of
    one term (two stages with a ``FullCodes`` scan), re-ranked by exact vectors ``ref_x`` or
    finer codes ``ref_codes`` where given."""

    rotate: HadamardRotate
    ref_x: np.ndarray | None = None
    ref_codes: CodeRefinement | None = None


@dataclass(frozen=True, kw_only=True)
class TermsSearchArgs(ScanSearchArgs):
    """A whole search through one query product (row ``terms_search_fused``; ``PCAIndex``):
    the query step x ``W``, each term's columns (``slices``), the scan over the terms."""

    W: torch.Tensor
    slices: list[slice]


@dataclass(frozen=True)
class IVFSearchArgs:
    """A whole IVF search (row ``ivf_search_fused``): ``probe`` -> ``rotate`` -> ``scan``
    (approximate with a refinement) -> padded rows to positions ``pos`` -> re-rank by exact
    vectors ``ref`` or ``ref_codes`` -> ids (``ids[position]``) and distances."""

    probe: IVFProbe
    rotate: HadamardRotate
    scan: IVFFastScan
    pos: np.ndarray
    ids: np.ndarray
    metric: str
    ref: torch.Tensor | None = None
    ref_codes: CodeRefinement | None = None


@dataclass(frozen=True)
class GraphSearchArgs:
    """A graph search over laid-out layers (row ``graph_search``): per layer the neighbour
    lists, their codes in fast-scan blocks, multipliers, offsets and slots (``layers``, lists
    by name), the entry's own one-node layer (``entry_layer``), the codes' ``bits``,
    ``centroids``; with ``rotate`` (and ``ids``, ``metric``, ``normalize``, ``refine_x``) also
    the whole search in one call."""

    layers: dict[str, list[np.ndarray]]
    entry_layer: dict[str, np.ndarray]
    n: int
    d: int
    bits: int
    centroids: torch.Tensor
    entry: int
    rotate: HadamardRotate | None = None
    ids: np.ndarray | None = None
    metric: str = "ip"
    normalize: bool = False
    refine_x: np.ndarray | None = None
