"""A flat index's lookup-table scan state: the codes' terms with the metric's per-row
multipliers and offsets, their fast-scan layout (kept across appends), and the prepared scans
of the CPU kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import ops
from ..codecs.base import Codec, Codes, LutTerm
from .fused import FlatSearch, TermsSearch
from .metrics import METRIC_COSINE, METRIC_L2
from .rerank import RefineLut
from .rows import Rows

__all__ = ["FlatScan", "BlockedCodes", "metric_terms", "rows_from_blocked", "sign_stage"]


@dataclass
class FlatScan:
    """What a flat index's LUT scan reads for one state of its rows:
    score_i = sum_t mults[t]_i <query_terms(q)[t], cents[t][idx_t,i]> + add_i is the metric's
    similarity (without the query's ||q||^2 for L2). On the CPU kernels ``scanner`` scans every
    term (several terms two-stage from the leading ones with a prefilter), or ``signs`` scans a
    sign plane first and re-scores its best rows with the full codes (a prefilter on
    TurboQuant-mse codes); ``fused`` runs the whole search in one compiled call where it can.
    Without them (no fast-scan layout) the packed terms serve ``ops.lut_scan``."""

    packed: list[torch.Tensor] | None  # None: the codes live in the scanner's layout only
    mults: list[torch.Tensor]
    cents: list[torch.Tensor]
    bits: list[int]
    add: torch.Tensor
    prefilter: int = 0  # the index's prefilter this state was built for
    scanner: ops.FastScan | None = None
    signs: ops.FastScan | None = None
    fused: FlatSearch | None = field(default=None, repr=False)
    mapped: TermsSearch | None = field(default=None, repr=False)  # FlatIndex.search_mapped

    @property
    def fast(self) -> bool:
        """Whether the CPU fast-scan kernels scan these rows."""
        return self.scanner is not None or self.signs is not None

    @property
    def first_pass(self) -> bool:
        """Whether that scan has a first pass (a prefilter) before it re-scores rows."""
        return self.signs is not None or (self.scanner is not None and self.scanner.first > 0)

    def scan_terms(self, blocked: list[torch.Tensor],
                   packed: list[torch.Tensor] | None = None) -> list[ops.ScanTerm]:
        """These terms for ``ops.FastScan`` over their fast-scan layout ``blocked``, with the
        ``packed`` rows a first pass over several terms re-scores from."""
        packed = packed or [None] * len(blocked)
        return [ops.ScanTerm(b, c, m, bits, p) for b, c, m, bits, p in
                zip(blocked, self.cents, self.mults, self.bits, packed, strict=True)]


def metric_terms(terms: list[LutTerm], n: int, scoring: int, sqnorms: torch.Tensor,
                 ipcorr: torch.Tensor, device: torch.device
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-term multipliers and the row offsets that make the terms' sum the metric's
    similarity: l2 2 est - N(x), cosine (or a rescaled inner product) est / sqrt(N(x)), plus a
    centred inner-product index's correction (``rowterms``)."""
    add = torch.zeros(n, dtype=torch.float32, device=device)
    if scoring == METRIC_L2:
        weight = torch.full((n,), 2.0, device=device)
        add = -sqnorms
    elif scoring == METRIC_COSINE or sqnorms.numel():
        weight = 1.0 / torch.sqrt(sqnorms.clamp_min(1e-30))
    else:
        weight = torch.ones(n, device=device)
    if ipcorr.numel():
        add = add + ipcorr
    mults = [(weight * t.scale).to(torch.float32).contiguous() for t in terms]
    return mults, add.to(torch.float32).contiguous()


def rows_from_blocked(blocked: torch.Tensor, slots: torch.Tensor, d: int, b: int
                      ) -> torch.Tensor:
    """Packed rows (len(slots), ceil(d b / 8)) of the given rows of a fast-scan layout (nb, fb,
    32): byte p of row s sits at blocked[s // 32, p, s % 32] - a gather of just those rows."""
    fb = blocked.shape[1]
    base = (slots // 32) * (fb * 32) + slots % 32
    rows = blocked.reshape(-1)[base[:, None] + torch.arange(fb, device=blocked.device) * 32]
    if b != 3:  # the layout's row is the packed row
        return rows
    m = len(slots)  # b = 3: the pair layout, unpacked by the layout's inverse
    pad = torch.zeros((-(-m // 32) * 32, fb), dtype=torch.uint8, device=blocked.device)
    pad[:m] = rows
    return ops.unblock_codes(pad.reshape(-1, 32, fb).transpose(1, 2), m, d, b)


class BlockedCodes:
    """The fast-scan layout (``ops.block_codes``) of an index's codes: either the codec's terms
    or its sign plane (a prefilter's first pass). Never changed once made: an index extends it
    into a new one (``lay_out``: the rows after the last whole 32-row block laid out and joined
    to the blocks before them) and replaces its own, so a search snapshot - and rows whose
    payload it serves (``payload``: the index then holds its codes once, see ``Rows``) - keep
    the layout they were made with."""

    def __init__(self, blocks: list[torch.Tensor] | None = None,
                 dims: tuple[tuple[int, int], ...] = (), n: int = 0, kind: str = "") -> None:
        self.blocks = blocks
        self.dims = dims  # (d, b) of each array
        self.n = n
        self.kind = kind

    def start(self, kind: str) -> int:
        """The first row a new layout of ``kind`` must lay out again: where the last whole
        block of this one ends (0 for another kind or none)."""
        return (self.n // 32) * 32 if self.blocks is not None and self.kind == kind else 0

    def lay_out(self, kind: str, parts: list[tuple[torch.Tensor, int, int]], n: int,
                start: int) -> BlockedCodes:
        """This layout extended to n rows: parts = (packed rows [start, n), d, b) per array."""
        blocks = []
        for i, (packed, d, b) in enumerate(parts):
            new = ops.block_codes(packed, d, b)
            old = self.blocks[i][: start // 32] if start else None
            blocks.append(new if old is None else torch.cat([old, new]))
        return BlockedCodes(blocks, tuple((d, b) for _, d, b in parts), n, kind)

    def sign_plane(self, codec: Codec, codes: Codes) -> tuple[BlockedCodes, LutTerm]:
        """This layout extended to the codec's sign plane (``Codec.sign_term``) of ``codes``
        (the fast-scan layout's one array), and the sign term of the rows laid out last (its d
        and centroids)."""
        start = self.start("signs")
        term = codec.sign_term(codes[start:])
        return self.lay_out("signs", [(term.packed, term.d, 1)], len(codes), start), term

    def payload(self, i0: int, i1: int) -> torch.Tensor:
        """Rows [i0, i1) of the laid out terms as row-major payload bytes (the terms' packed
        rows side by side, as ``Codec.lut_terms`` cut them)."""
        slots = torch.arange(i0, i1, device=self.blocks[0].device)
        cols = [rows_from_blocked(bl, slots, d, b)
                for bl, (d, b) in zip(self.blocks, self.dims, strict=True)]
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)


@dataclass(frozen=True)
class FlatSnapshot:
    """What a flat index's search reads, taken together under the index's lock."""

    rows: Rows  # ``Rows.snapshot``
    scan: FlatScan | None
    ref_lut: RefineLut | None

    @property
    def n(self) -> int:
        return self.rows.n


def sign_stage(codec: Codec, scoring: int, sigmas: float, term: LutTerm, scan: FlatScan,
               rows: Rows, device: torch.device) -> ops.FullCodes:
    """The full codes behind a flat index's sign-plane first pass (``term``: the plane), with
    that pass's own offsets and multipliers: bounded by its error (``sigmas`` > 0) the full
    codes' estimate from the signs (``Codec.sign_term_error``: each row's gain times its full
    multiplier, the full offsets; the bound ``sigmas`` standard deviations wide, the angle's
    sine at least 1 / sqrt(d), the resolution of its estimate); by a count, the signs' own
    estimate."""
    mults, add, n, d = scan.mults, scan.add, rows.n, codec.dim
    if sigmas:
        model = codec.sign_term_error()
        gains = codec.sign_term_gains(rows.codes).to(device=device, dtype=torch.float32)
        bound = ops.SignBound(sigmas * model.noise, model.gain, model.cnorm, 1.0 / math.sqrt(d))
        return ops.FullCodes(scan.packed[0], scan.bits[0], scan.cents[0], add,
                             (gains * mults[0]).contiguous(), bound)
    # every row's first-pass term (the plane's rows were laid out in appends)
    first_term = LutTerm(None, term.d, 1, term.centroids, codec.sign_scale(rows.scalar_codes()))
    add1 = add
    prefix = term.d < d  # 1-bit codes: a prefix of the coordinates scores ~d1/d
    if prefix:
        add1 = (add1 * (term.d / d)).contiguous()
    if scoring == METRIC_L2 and not (prefix and codec.unbiased_ip):
        # Rank the first pass by the distance to the 1-bit reconstruction, m c1[sign] (m the
        # sign term's scale, norm^2 = m^2 d c1^2), not with the full code's ||x_hat||^2: its
        # inner products are ~2/pi smaller, and mixing the two scales ranks short vectors
        # first. An unbiased 1-bit prefix instead scores ~d1/d of <q, x>, paired with d1/d of
        # ||x||^2 (above).
        add1 = -(first_term.scale ** 2 * (float(term.centroids[1]) ** 2 * term.d)).contiguous()
    mult1, _ = metric_terms([first_term], n, scoring, rows.term("sqnorms", device),
                            rows.term("ipcorr", device), device)
    return ops.FullCodes(scan.packed[0], scan.bits[0], scan.cents[0], add1,
                         None if torch.equal(mult1[0], mults[0]) else mult1[0])
