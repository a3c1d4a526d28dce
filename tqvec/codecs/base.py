"""The codec interface and the ``Codes`` container shared by every codec.

A codec is fixed by ``(name, dim, params, seed)``: there is no fit/train step. ``encode`` works
in blocks of ``BLOCK_ROWS`` rows (far more on a GPU: ``block_rows``), so its peak memory is
O(n * code_size) plus one block.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from .. import _validate as V

__all__ = ["Codes", "Codec", "KernelForm", "LutTerm", "SignTermError", "codec_from_params",
           "register",
           "concat_codes", "BLOCK_ROWS", "score_from_terms"]

BLOCK_ROWS = 8192
#: On a GPU a block holds up to this many elements (256 MB of float32 per intermediate): each
#: block costs a dozen launches and a host read of its finiteness check, so a GPU wants blocks
#: far larger than a CPU's cache-sized ones.
GPU_BLOCK_ELEMENTS = 1 << 26
_REGISTRY: dict[str, type[Codec]] = {}


def block_rows(device: torch.device, width: int) -> int:
    """Rows per block of the codec loops on ``device``: BLOCK_ROWS on the CPU (cache-sized),
    far more on a GPU."""
    if device.type == "cpu":
        return BLOCK_ROWS
    return max(BLOCK_ROWS, GPU_BLOCK_ELEMENTS // max(1, width))


def register(cls: type[Codec]) -> type[Codec]:
    _REGISTRY[cls.name] = cls
    return cls


def codec_from_params(params: Mapping[str, Any], *, strict: bool = False) -> Codec:
    """Rebuild a codec from ``Codec.params`` (e.g. read from a file header).

    ``strict=True`` (file readers) also refuses keys that are not params (``backend``) and
    params that are not exactly what the rebuilt codec reports (a default spelled out, a
    float for an int): a header is trusted only in the one form tqvec writes.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping, got {type(params).__name__}")
    params = dict(params)
    name = params.pop("codec", None)
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"codec must be one of {sorted(_REGISTRY)}, got {name!r}")
    if strict and "backend" in params:
        raise ValueError("params must not hold 'backend' (a choice of the reader, not of the "
                         "codes)")
    codec = _REGISTRY[name].from_params(params)
    if strict and codec.params != {"codec": name, **params}:
        raise ValueError(f"params must be canonical, got {dict(params)} for {codec!r}")
    return codec


class SignTermError(NamedTuple):
    """How a codec's sign-term estimate relates to its full codes' (``Codec.sign_term_error``),
    for the rotated query q and a row with multiplier m, full-code centroids c and signs s:
    m <q, c> = gains_row m <q, c1 s> + err, err ~ N(0, (noise |m| ||q|| sin)^2), sin the angle
    between q and c, whose cosine the sign estimate gives as gain <q, c1 s> / (cnorm ||q||);
    ``Codec.sign_term_gains`` gives each row's gain (about ``gain``)."""

    gain: float
    noise: float
    cnorm: float


class LutTerm(NamedTuple):
    """One term of a codec's estimator over its packed codes, for lookup-table scans: the term's
    vector of row i is ``centroids[unpack_bits(packed[i], d, bits)]``, scaled by ``scale[i]``,
    and pairs with the matching ``query_terms`` entry (QJL signs: bits 1, centroids (-1, +1))."""

    packed: torch.Tensor  # (n, ceil(d bits / 8)) uint8
    d: int
    bits: int
    centroids: torch.Tensor  # (2^bits,) float32
    scale: torch.Tensor  # (n,) float32


@dataclass(frozen=True)
class KernelForm:
    """What a codec declares when its estimator is one scalar-code term in a rotated domain:

        x_hat = Pi^T (m * c[idx]),    <q, x_hat> = m * <Pi q, c[idx]>

    with ``idx`` the ``bits``-bit indices packed as the whole payload (``ops.pack_bits``), ``c``
    the codec's centroids (``centroids_on``, a ``codebook`` with its thresholds), ``Pi`` its
    rotation (``rotate`` / ``unrotate``; ``query_rotation(device)`` the prepared op of a
    Hadamard rotation, None for a dense one) and ``m`` each row's multiplier (``multiplier``). The
    search and KV layers build their fast paths from these parts - the fast-scan, fused and
    graph searches, rotated-domain re-scoring, the decode-attention kernels - so a codec of
    this form gets all of them by returning one from ``kernel_form``. Reading it draws nothing.
    """

    bits: int  # width of each index, 1..8
    #: the stored scalar that *is* m (the kernels read it as stored); None where m is
    #: computed from several scalars (e.g. the norm over a correction)
    multiplier_field: str | None
    #: m is the stored true norm ||x|| (exporters to formats that store a norm need this)
    multiplier_is_norm: bool


@dataclass(frozen=True, eq=False)
class Codes:
    """Encoded vectors: packed payload + per-vector scalars + the codec's params.

    payload: (n, payload_bytes) uint8, row-major, LSB-first bit packing (segments per codec).
    scalars: name -> (n,) or (n, k) float32/float16 tensor (norms, residual norms, radii).
    params:  the codec's ``params`` dict (JSON-serializable), enough to rebuild the codec.
    source:  the ``tqvec.io.MappedFile`` the tensors are memory-mapped from (``load_codes(...,
             mmap=True)``), checked for changes at each use (``Codec.check_codes``); None for
             codes in memory.
    """

    payload: torch.Tensor
    scalars: Mapping[str, torch.Tensor]
    params: Mapping[str, Any] = field(default_factory=dict)
    source: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.payload.dtype != torch.uint8 or self.payload.ndim != 2:
            raise TypeError(f"payload must be a 2-D uint8 tensor, got {V.describe(self.payload)}")
        n = self.payload.shape[0]
        for k, v in self.scalars.items():
            if v.shape[0] != n:
                raise ValueError(f"scalars[{k!r}] must have {n} rows, got {tuple(v.shape)}")

    def __len__(self) -> int:
        return int(self.payload.shape[0])

    @property
    def dim(self) -> int:
        return int(self.params["dim"])

    @property
    def device(self) -> torch.device:
        return self.payload.device

    @property
    def code_size(self) -> int:
        """Bytes stored per vector, side information included."""
        per = self.payload.shape[1]
        for v in self.scalars.values():
            per += v.element_size() * (v[0].numel() if v.ndim > 1 else 1)
        return int(per)

    @property
    def nbytes(self) -> int:
        return len(self) * self.code_size

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> Codes:
        if isinstance(key, (int, np.integer)):
            n = len(self)
            if not -n <= int(key) < n:
                raise IndexError(f"index {int(key)} is out of range for {n} codes")
            key = slice(int(key) % n, int(key) % n + 1)
        if isinstance(key, slice):  # a view: still reads the mapped file
            return Codes(self.payload[key], {k: v[key] for k, v in self.scalars.items()},
                         self.params, self.source)
        key = torch.as_tensor(np.asarray(key) if not isinstance(key, torch.Tensor) else key)
        if key.dtype == torch.bool:
            if key.shape != (len(self),):
                raise ValueError(f"boolean mask must have shape ({len(self)},), "
                                 f"got {tuple(key.shape)}")
        elif key.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"index must be int, slice, int array or bool mask, got {key.dtype}")
        key = key.to(self.payload.device)
        return Codes(self.payload[key], {k: v[key] for k, v in self.scalars.items()},
                     self.params)

    def __iter__(self) -> Iterator[Codes]:
        for i in range(len(self)):
            yield self[i]

    def to(self, device: str | torch.device) -> Codes:
        payload = self.payload.to(device)
        return Codes(payload, {k: v.to(device) for k, v in self.scalars.items()}, self.params,
                     self.source if payload is self.payload else None)

    def __repr__(self) -> str:
        return (f"Codes(n={len(self)}, codec={self.params.get('codec')!r}, dim={self.dim}, "
                f"code_size={self.code_size} B, device={self.device})")


def concat_codes(parts: Sequence[Codes]) -> Codes:
    """Concatenate codes of the same codec (same params) along the rows."""
    if not parts:
        raise ValueError("parts must hold at least one Codes, got an empty sequence")
    p0 = dict(parts[0].params)
    for i, c in enumerate(parts):
        if not isinstance(c, Codes):
            raise TypeError(f"parts[{i}] must be Codes, got {type(c).__name__}")
        if dict(c.params) != p0:
            raise ValueError(f"parts[{i}] was encoded with {dict(c.params)}, expected {p0}")
    return Codes(torch.cat([c.payload for c in parts]),
                 {k: torch.cat([c.scalars[k] for c in parts]) for k in parts[0].scalars}, p0)


Codes.concat = staticmethod(concat_codes)  # type: ignore[attr-defined]


class Codec:
    """Base class: ``encode`` / ``decode`` / ``score`` with no training.

    Subclasses implement ``encode_block(x float32 (B, d), norms (B,)) -> (payload, scalars)``,
    ``decode_block(codes) -> float32 (B, d)``, ``_prepare_queries(q float32) -> state`` and
    ``_score_block(state, codes) -> float32 (nq, B)``.
    """

    name: ClassVar[str] = ""
    dim: int
    seed: int
    backend: str

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Codec:
        """The codec of ``params`` without its ``"codec"`` key; codecs whose defaults changed
        override it to read params written before (a missing key meant the old default)."""
        return cls(**params)

    # -- to implement -----------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def payload_bytes(self) -> int:
        raise NotImplementedError

    def _scalar_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (per-vector shape, dtype) of the stored scalars."""
        raise NotImplementedError

    def encode_block(self, x: torch.Tensor, norms: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Encode checked rows x (B, d) float32 with their norms (B,): (payload, scalars).
        ``encode`` validates and calls this per block; a codec made of codecs (``MixedTurboQuant``)
        calls its parts' directly."""
        raise NotImplementedError

    def decode_block(self, codes: Codes) -> torch.Tensor:
        """Decode checked codes -> (B, d) float32 (``decode`` validates and calls it per block)."""
        raise NotImplementedError

    def _decode_rows(self, device: torch.device) -> int:
        """Rows per ``decode_block`` call: cache-sized blocks (``block_rows``) bound the
        intermediates of a decode made of torch steps; a codec whose decode is one compiled
        call that works through the rows in cache-sized chunks itself takes them all at once
        (no copy of each block's output into the result)."""
        return block_rows(device, self.dim)

    def _prepare_queries(self, q: torch.Tensor) -> Any:
        return self.query_terms(q)

    def _score_block(self, state: Any, codes: Codes) -> torch.Tensor:
        return score_from_terms(state, self.code_terms(codes))

    def kernel_form(self) -> KernelForm | None:
        """The codec's estimator as one rotated-domain scalar term (``KernelForm``), or None:
        the index and KV layers then use the term form below or decoded blocks. A codec that
        returns a form implements ``rotate``, ``unrotate``, ``query_rotation``,
        ``centroids_on``, ``codebook`` and ``multiplier`` as the form describes them."""
        return None

    # The asymmetric estimator as a sum of scaled dot products:
    #   score(q, x) = sum_i scale_i(x) * <query_terms(q)[i], code_terms(x)[i][0]>.
    # Codecs whose estimator has this form (TurboQuant, QJL) implement the two methods; ``score``,
    # the index and the KV-cache attention all evaluate it through them (the attention batches
    # it over heads without a Python loop).
    def query_terms(self, q: torch.Tensor) -> list[torch.Tensor]:
        """q (n, d) float32 -> list of (n, k_i) float32 query-side terms."""
        raise NotImplementedError(f"{type(self).__name__} has no term form of its estimator")

    def code_terms(self, codes: Codes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """codes -> list of ((n, k_i) float32 code-side term, (n,) float32 scale)."""
        raise NotImplementedError(f"{type(self).__name__} has no term form of its estimator")

    # The same estimator over the packed codes, for lookup-table scans: term i of
    # ``query_terms`` pairs with ``lut_terms(codes)[i]``, a ``LutTerm`` whose vector is
    # code_terms' (QJL signs: b = 1, centroids (-1, +1)).
    def lut_term_bits(self) -> list[int] | None:
        """Widths of the ``lut_terms``, or None when the codes are not scalar-quantized terms."""
        return None

    def lut_terms(self, codes: Codes) -> list[LutTerm]:
        raise NotImplementedError(f"{type(self).__name__} has no lookup-table form of its codes")

    def has_sign_term(self) -> bool:
        """Whether ``sign_term`` gives a coarse first pass (an index's ``prefilter``)."""
        return False

    def first_pass_terms(self) -> int:
        """How many leading ``lut_terms`` a two-stage search's first pass scores (an index's
        ``prefilter`` for codecs with several terms, e.g. ``MixedTurboQuant``'s leading runs);
        0: none (``has_sign_term`` is the other kind of first pass)."""
        return 0

    def sign_term(self, codes: Codes) -> LutTerm | None:
        """A 1-bit coarse version of the single ``lut_terms`` entry (paired with the same query
        term) for a two-stage scan, or None when the codec has none."""
        return None

    def sign_scale(self, codes: Codes) -> torch.Tensor:
        """The per-row scale of ``sign_term``'s entry, from the codes' scalars alone."""
        raise NotImplementedError(f"{type(self).__name__} has no sign term")

    def sign_term_error(self) -> SignTermError | None:
        """The error model of the sign term's estimate against the full codes' (an
        error-bounded first pass), or None where the codec has none."""
        return None

    def sign_term_gains(self, codes: Codes) -> torch.Tensor:
        """Each row's gain (``SignTermError``): the factor that makes the sign estimate's
        error orthogonal to the row's own full-code direction."""
        raise NotImplementedError(f"{type(self).__name__} has no sign-term error model")

    #: True when ``score`` is an unbiased estimate of <q, x> (then L2 search must pair it with
    #: the true ||x||^2, not with ||x_hat||^2, which carries the estimator's noise).
    unbiased_ip: bool = False

    def true_sqnorms(self, codes: Codes) -> torch.Tensor:
        """(n,) stored ||x||^2 (exact up to the norm dtype), for codecs that store the norm."""
        raise NotImplementedError(f"{type(self).__name__} does not store the true norm")

    def decoded_sqnorms(self, codes: Codes) -> torch.Tensor:
        """||decode(codes)||^2 per vector (B,); codecs override this with a rotation-free form."""
        return (self.decode_block(codes) ** 2).sum(1)

    def reconstruction_sqnorms(self, codes: Codes) -> torch.Tensor:
        """(n,) float32 squared norms of the decoded vectors (what L2 search against the
        reconstruction needs: ||q - x_hat||^2 = ||q||^2 - 2 <q, x_hat> + ||x_hat||^2)."""
        codes = self.check_codes(codes)
        out = torch.empty(len(codes), dtype=torch.float32, device=codes.device)
        step = block_rows(codes.device, self.dim)
        for s in range(0, len(codes), step):
            e = min(len(codes), s + step)
            out[s:e] = self.decoded_sqnorms(codes[s:e])
        return out

    def fingerprint_arrays(self) -> list[np.ndarray]:
        """Every materialized random/codebook array that decoding depends on."""
        raise NotImplementedError

    def draw_work(self) -> int:
        """What materializing the arrays of ``fingerprint_arrays`` costs (elements drawn plus
        QR multiply-adds, ``tqvec.random.jl_work``), known without drawing: a file reader checks
        a fingerprint at once only where this is small next to the file."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------
    def scalar_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (per-vector shape, dtype) of the scalars stored beside the payload."""
        return dict(self._scalar_layout())

    @property
    def code_size(self) -> int:
        """Bytes stored per vector: packed payload plus per-vector scalars."""
        per = self.payload_bytes
        for shape, dtype in self._scalar_layout().values():
            per += int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return per

    @property
    def bits_per_dim(self) -> float:
        return 8.0 * self.code_size / self.dim

    def fingerprint(self) -> str:
        """sha256 of every materialized array the codec decodes with (stored in files)."""
        h = hashlib.sha256(json.dumps(self.params, sort_keys=True).encode())
        for a in self.fingerprint_arrays():
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if k != "codec")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.params == other.params

    def __hash__(self) -> int:
        return hash(json.dumps(self.params, sort_keys=True))

    def encode(self, x: Any) -> Codes:
        """Encode ``x``: (n, d) float32 | float16 | bfloat16, numpy or torch -> ``Codes``."""
        t, _ = V.float_matrix(x, "x", self.dim, check_finite=False)  # checked per block
        n = t.shape[0]
        layout = self._scalar_layout()
        step = block_rows(t.device, self.dim)
        if 0 < n <= step:
            # one block: its own outputs are the codes (a few rows - a KV cache's window
            # block, one added vector - cost more in copies than in arithmetic)
            p, sc = self._encode_rows(t, 0)
            return Codes(p.contiguous(), {k: sc[k].to(dt).contiguous()
                                          for k, (_, dt) in layout.items()}, self.params)
        payload = torch.empty((n, self.payload_bytes), dtype=torch.uint8, device=t.device)
        scalars = {k: torch.empty((n, *shape), dtype=dt, device=t.device)
                   for k, (shape, dt) in layout.items()}
        for s in range(0, n, step):
            e = min(n, s + step)
            p, sc = self._encode_rows(t[s:e], s)
            payload[s:e] = p
            for k in layout:
                scalars[k][s:e] = sc[k]
        return Codes(payload, scalars, self.params)

    def _encode_rows(self, rows: torch.Tensor, offset: int
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One block of ``encode``: its rows (starting at row ``offset`` of the input) checked
        for NaN/Inf through their norms, then ``encode_block``."""
        block = rows.to(torch.float32)
        norms = torch.linalg.vector_norm(block, dim=1)
        V.finite_rows(block, norms, "x", offset)
        return self.encode_block(block, norms)

    def check_codes(self, codes: Any, name: str = "codes") -> Codes:
        if not isinstance(codes, Codes):
            raise TypeError(f"{name} must be tqvec.Codes, got {type(codes).__name__}")
        if dict(codes.params) != self.params:
            raise ValueError(f"{name} were encoded with {dict(codes.params)}, but this codec is "
                             f"{self.params}")
        V.uint8_codes(codes.payload, f"{name}.payload", self.payload_bytes)
        layout = self._scalar_layout()
        for k, (shape, dt) in layout.items():
            if k not in codes.scalars or tuple(codes.scalars[k].shape[1:]) != shape:
                raise ValueError(f"{name}.scalars[{k!r}] must have per-vector shape {shape}")
            if codes.scalars[k].dtype != dt:
                raise TypeError(f"{name}.scalars[{k!r}] must have dtype {dt}, got "
                                f"{codes.scalars[k].dtype}")
        if set(codes.scalars) != set(layout):
            raise ValueError(f"{name}.scalars must hold {sorted(layout)}, got "
                             f"{sorted(codes.scalars)}")
        if codes.source is not None:
            codes.source.check()
        return codes

    def decode(self, codes: Codes, *, like: Any = None) -> Any:
        """Reconstruct (n, d) float32. Returns numpy if the codes were made from numpy input
        (``like`` decides when given: a numpy array or a torch tensor), else torch."""
        codes = self.check_codes(codes)
        step = self._decode_rows(codes.device)
        if 0 < len(codes) <= step:  # one block: no copy into a second tensor
            out = self.decode_block(codes).to(torch.float32).contiguous()
        else:
            out = torch.empty((len(codes), self.dim), dtype=torch.float32, device=codes.device)
            for s in range(0, len(codes), step):
                e = min(len(codes), s + step)
                out[s:e] = self.decode_block(codes[s:e])
        return out.cpu().numpy() if isinstance(like, np.ndarray) else out

    def score(self, q: Any, codes: Codes) -> Any:
        """Asymmetric estimates of <q_i, x_j>: (nq, n) float32; q stays exact (not quantized).

        numpy ``q`` gives a numpy result, a torch ``q`` a torch result.
        """
        codes = self.check_codes(codes)
        qt, was_numpy = V.float_matrix(q, "q", self.dim)
        qt = qt.to(device=codes.device, dtype=torch.float32)
        state = self._prepare_queries(qt)
        out = torch.empty((qt.shape[0], len(codes)), dtype=torch.float32, device=codes.device)
        step = block_rows(codes.device, self.dim)
        for s in range(0, len(codes), step):
            e = min(len(codes), s + step)
            out[:, s:e] = self._score_block(state, codes[s:e])
        return out.cpu().numpy() if was_numpy else out


def score_from_terms(qterms: Sequence[torch.Tensor],
                     cterms: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(nq, n) = sum_i (qterms[i] @ cterms[i][0].T) * cterms[i][1]."""
    out = None
    for qt, (ct, scale) in zip(qterms, cterms, strict=True):
        part = (qt @ ct.T) * scale[None, :]
        out = part if out is None else out + part
    return out


def inverse_norms(nrm: torch.Tensor) -> torch.Tensor:
    """1 / norm, and 0 for a zero row (so it encodes to norm 0 and decodes to zeros)."""
    # reciprocal() is what ``1.0 / nrm`` computes (Tensor.__rdiv__), without its extra product
    return torch.where(nrm > 0, nrm.reciprocal(), 0.0)


def store_norm(nrm: torch.Tensor, dtype: torch.dtype, name: str = "norm",
               option: str = "norm_dtype") -> torch.Tensor:
    """Cast norms to the storage dtype; float16 raises instead of storing inf."""
    if dtype == torch.float16 and V.any_above(nrm, 65504.0):
        raise ValueError(f"{name} must fit in float16 (<= 65504) with {option}='float16', got "
                         f"{float(nrm.max()):.6g}; use {option}='float32'")
    return nrm.to(dtype)


NORM_DTYPES = {"float32": torch.float32, "float16": torch.float16}
