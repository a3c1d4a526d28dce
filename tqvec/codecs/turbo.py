"""TurboQuant (Zandieh et al.): random rotation + Lloyd-Max scalar quantization.

``variant="mse"`` (Algorithm 1): x -> (||x||, idx = Q(Pi x / ||x||)), b bits per coordinate;
decode ||x|| Pi^T c[idx]; E||x - x_hat||^2 / ||x||^2 is the Lloyd-Max cost (Theorem 1).

``variant="prod"`` (Algorithm 2): (b-1)-bit mse codes, then the unit residual
r = Pi x/||x|| - c[idx] sketched as sign(S r) with m rows (default m = d) and gamma = ||r||; the
estimate <q, x> ~ ||x|| (<Pi q, c[idx]> + gamma sqrt(pi/2)/m <S Pi q, sign(S r)>) is unbiased
(Theorem 2). The residual is sketched in the rotated domain: S Pi has the distribution of S
(S is rotation invariant), so this is the paper's estimator without an inverse rotation.

The pseudocode calls the mse stage "PolarQuant"; it is not the recursive polar transform of the
PolarQuant paper (that is ``tqvec.PolarQuant``) but the rotation + Lloyd-Max of Algorithm 1.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codebooks import Codebook, sphere_codebook, sphere_grid_codebook
from ..random import (
    JL_KINDS,
    JL_VERSION,
    JL_VERSIONS,
    ROTATIONS,
    HadamardRotation,
    Rotation,
    haar_check,
    jl_check,
    jl_matrix,
    jl_work,
    make_rotation,
    rotation_work,
)
from ._common import DeviceCache, qjl_scale, sign_pack, signs_pm1
from .base import (
    NORM_DTYPES,
    Codec,
    Codes,
    KernelForm,
    LutTerm,
    SignTermError,
    inverse_norms,
    register,
    store_norm,
)

__all__ = ["TurboQuant"]


@register
class TurboQuant(Codec):
    """TurboQuant codec.

    Parameters
    ----------
    dim: vector dimension d >= 2.
    bits: bits per coordinate b (1..8). For ``prod``, b-1 go to the mse stage and 1 to QJL.
    variant: ``"mse"`` (best reconstruction and ranking) or ``"prod"`` (unbiased inner products).
    seed: fixes the rotation (and the QJL matrix).
    rotation: ``"hadamard"`` (multi-round randomized Hadamard, O(d log d)) or ``"haar"`` (dense
        Haar matrix as in the paper, O(d^2)).
    rounds: Hadamard rounds (default 3).
    sketch_dim: QJL rows m for ``prod`` (default d).
    jl: ``"orthogonal"`` (default) or ``"gaussian"`` rows for the QJL matrix.
    jl_version: the orthogonal draw for sketch_dim < dim (``tqvec.random.JL_VERSIONS``; 1 only
        to decode codes written before version 2).
    norm_dtype: ``"float32"`` (default) or ``"float16"`` for the stored norms.
    scale: ``"norm"`` (default, the paper: store ||x||, decode ||x|| Pi^T c[idx]) or
        ``"unbiased"`` (mse only; EDEN's scale ||x|| / <u, c[idx]> with u = Pi x / ||x||, so
        that <x_hat, x> = ||x||^2 exactly). The unbiased scale stores the correction
        <u, c[idx]> as float16 beside the norm (+2 bytes): the norm itself is still needed to
        pair the unbiased inner product with ||x||^2 in L2 and cosine search. It removes the
        per-vector shrinkage of inner products, at a slightly higher MSE (~D / (1 - D)).
        Or ``"fit"`` (mse only): store m = ||x|| <u, c[idx]> / ||c[idx]||^2 instead of the norm
        (same bytes) and decode m Pi^T c[idx] - the least-squares scale of the chosen centroids,
        the lowest error they allow (||x||^2 (1 - cos^2(u, c[idx])) against ||x||^2 ||u -
        c[idx]||^2 for the norm's). Same indices as ``"norm"``; biased like it, so search ranks
        by the distance to the reconstruction. The per-vector fit is what EDEN's and RaBitQ's
        corrections buy on low-rank data (docs/benchmarks.md: Fashion-MNIST, the norm's scale
        against the fitted one). It
        stores no true norm: inner-product search (not cosine) uses <q, x_hat> as it is.
    codebook: ``"lloyd-max"`` (default, the paper: the optimal scalar quantizer of a rotated
        coordinate) or ``"grid"``: the best uniform grid for the same law
        (``codebooks.sphere_grid_codebook``; same bytes, more error except at 1 bit: at d = 784
        0.1186 vs 0.1172 at 2 bits, 8.7e-5 vs 4.1e-5 at 8). Its centroids are
        (step / 2) (2 i - K + 1), so the CPU re-scoring kernel (``ops.lut_rescore``, an index's
        ``Refine(TQ8g)``) decodes them with integer-to-float conversions instead of a table
        gather per coordinate.
    backend: ``"auto"``, ``"ref"``, ``"cpu"`` or ``"cuda"``.
    """

    name = "turboquant"

    def __init__(self, dim: int, bits: int = 4, variant: str = "mse", seed: int = 0, *,
                 rotation: str = "hadamard", rounds: int = 3, sketch_dim: int | None = None,
                 jl: str = "orthogonal", norm_dtype: str = "float32", scale: str = "norm",
                 codebook: str = "lloyd-max", jl_version: int = JL_VERSION,
                 backend: str = "auto"):
        self.dim = V.positive_int(dim, "dim", 2, V.MAX_DIM)
        self.bits = V.positive_int(bits, "bits", 1, 8)
        self.variant = V.choice(variant, "variant", ("mse", "prod"))
        self.seed = V.seed(seed)
        self.rotation = V.choice(rotation, "rotation", ROTATIONS)
        self.rounds = V.positive_int(rounds, "rounds", 1, 16)
        self.jl = V.choice(jl, "jl", JL_KINDS)
        self.jl_version = V.positive_int(jl_version, "jl_version", 1, max(JL_VERSIONS))
        self.norm_dtype = V.choice(norm_dtype, "norm_dtype", tuple(NORM_DTYPES))
        self.backend = V.choice(backend, "backend", ops.BACKENDS)
        self.scale = V.choice(scale, "scale", ("norm", "unbiased", "fit"))
        self.codebook_kind = V.choice(codebook, "codebook", ("lloyd-max", "grid"))
        prod = self.variant == "prod"
        if prod and self.scale != "norm":
            raise ValueError("scale must be 'norm' for variant='prod' (its QJL term already "
                             f"makes inner products unbiased), got {scale!r}")
        if sketch_dim is not None and not prod:
            raise ValueError("sketch_dim must be None for variant='mse' (it sizes the QJL "
                             f"residual sketch of variant='prod'), got {sketch_dim}")
        self.sketch_dim = V.positive_int(sketch_dim, "sketch_dim", 1, V.MAX_DIM) if sketch_dim \
            else (self.dim if prod else 0)
        self.mse_bits = self.bits - 1 if prod else self.bits
        # the dense matrices' sizes are refused now; the arrays are drawn at first use
        if self.rotation == "haar":
            haar_check(self.dim)
        if prod:
            jl_check(self.sketch_dim, self.dim, self.jl, self.jl_version)
        self._mse_bytes = ops.row_bytes(self.dim, self.mse_bits)
        self._sign_bytes = ops.row_bytes(self.sketch_dim, 1) if prod else 0

    # -- materialized lazily: a codec is cheap to build from params (a file's header is checked
    # against its arrays before anything large is drawn) ---------------------------------------
    @functools.cached_property
    def _rot(self) -> Rotation:
        return make_rotation(self.rotation, self.dim, self.seed,
                             self.rounds if self.rotation == "hadamard" else 3)

    @functools.cached_property
    def codebook(self) -> Codebook | None:
        """The mse stage's scalar codebook (None for prod at 1 bit: no mse stage)."""
        if not self.mse_bits:
            return None
        return (sphere_grid_codebook if self.codebook_kind == "grid" else sphere_codebook)(
            self.dim, self.mse_bits)

    @functools.cached_property
    def _arr(self) -> DeviceCache:
        arrays: dict[str, np.ndarray] = {}
        if self.mse_bits:
            arrays["centroids"] = self.codebook.centroids.astype(np.float32)
            arrays["thresholds"] = self.codebook.thresholds.astype(np.float32)
        if self.variant == "prod":
            arrays["S"] = jl_matrix(self.sketch_dim, self.dim, self.seed, self.jl,
                                    purpose="turboquant.qjl",
                                    version=self.jl_version).astype(np.float32)
        return DeviceCache(**arrays)

    # -- description ------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"codec": self.name, "dim": self.dim, "bits": self.bits,
                             "variant": self.variant, "seed": self.seed,
                             "rotation": self.rotation, "norm_dtype": self.norm_dtype}
        if self.rotation == "hadamard":
            p["rounds"] = self.rounds
        if self.scale != "norm":
            p["scale"] = self.scale
        if self.codebook_kind != "lloyd-max":  # absent in files written before the grid
            p["codebook"] = self.codebook_kind
        if self.variant == "prod":
            p["sketch_dim"] = self.sketch_dim
            p["jl"] = self.jl
            if self.jl == "orthogonal" and self.sketch_dim < self.dim and self.jl_version > 1:
                # the draws differ only for m < d; absent: version 1 (files written before)
                p["jl_version"] = self.jl_version
        return p

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> TurboQuant:
        return cls(**{"jl_version": 1, **params})  # absent: written before version 2

    @property
    def payload_bytes(self) -> int:
        return self._mse_bytes + self._sign_bytes

    def _scalar_layout(self):
        dt = NORM_DTYPES[self.norm_dtype]
        lay = {"fit" if self.scale == "fit" else "norm": ((), dt)}
        if self.variant == "prod" and self.mse_bits:
            lay["rnorm"] = ((), dt)
        if self.scale == "unbiased":
            lay["corr"] = ((), torch.float16)
        return lay

    @property
    def unbiased_ip(self) -> bool:  # type: ignore[override]
        return self.variant == "prod" or self.scale == "unbiased"

    def true_sqnorms(self, codes: Codes) -> torch.Tensor:
        if self.scale == "fit":
            raise NotImplementedError("TurboQuant(scale='fit') stores the fitted scale, not the "
                                      "true norm")
        return codes.scalars["norm"].float() ** 2

    def multiplier(self, codes: Codes) -> torch.Tensor:
        """Per-vector factor on the rotated-domain reconstruction: ||x||, ||x|| / <u, c> or
        ||x|| <u, c> / ||c||^2."""
        if self.scale == "fit":
            return codes.scalars["fit"].float()
        m = codes.scalars["norm"].float()
        if self.scale == "unbiased":
            m = m / codes.scalars["corr"].float()
        return m

    def centroids_on(self, device: torch.device) -> torch.Tensor:
        """The mse stage's float32 centroids on ``device`` (cached per device)."""
        return self._arr.get("centroids", device)

    def draw_work(self) -> int:
        work = rotation_work(self.rotation, self.dim, self.rounds)
        if self.variant == "prod":
            work += jl_work(self.sketch_dim, self.dim, self.jl, self.jl_version)
        return work

    def fingerprint_arrays(self):
        out = [np.frombuffer(self._rot.fingerprint().encode(), np.uint8)]
        for k in ("centroids", "thresholds", "S"):
            if k in self._arr.host:
                out.append(self._arr.host[k].numpy())
        return out

    @property
    def expected_mse(self) -> float:
        """E||x - x_hat||^2 / ||x||^2 of the mse stage (the exact Lloyd-Max cost)."""
        return self.codebook.mse if self.codebook is not None else 1.0

    # -- encode -----------------------------------------------------------------------------
    def encode_block(self, x: torch.Tensor, nrm: torch.Tensor):
        dev = x.device
        dt = NORM_DTYPES[self.norm_dtype]
        if self._one_call_encode(dev):
            # the steps below in one compiled call (the same bits; ops.turbo_mse_encode)
            rot = self._rot.op(dev)
            packed, fit = ops.turbo_mse_encode(
                x, nrm, rot.perms, rot.signs, rot.p, self._arr.get("thresholds", dev),
                self._arr.get("centroids", dev), self.mse_bits, self.scale == "fit",
                self.backend)
            return packed, ({"fit": store_norm(fit, dt, "fit")} if fit is not None
                            else {"norm": store_norm(nrm, dt)})
        inv = inverse_norms(nrm)
        y = self._rot.apply(x)
        scalars = {"norm": store_norm(nrm, dt)} if self.scale != "fit" else {}
        parts = []
        if self.mse_bits:
            packed = ops.quantize_pack(y, inv, self._arr.get("thresholds", dev), self.mse_bits,
                                       self.backend)
            parts.append(packed)
            if self.scale in ("fit", "unbiased"):
                # <u, c> and ||c||^2 of the chosen centroids c, u = y / ||x|| (one compiled
                # pass over the codes, no (n, d) centroid tensor)
                csq, dot = ops.centroid_stats(packed, self.dim, self.mse_bits,
                                              self._arr.get("centroids", dev), y, inv,
                                              self.backend)
            if self.scale == "fit":
                # <u, c> >= 0 term by term and ||c||^2 > 0 (no zero centroid): m = 0 only for a
                # zero vector
                scalars["fit"] = store_norm(nrm * dot / csq, dt, "fit")
            if self.scale == "unbiased":
                # <u, c[idx]> >= 0 term by term (symmetric codebook with a threshold at 0); it
                # is 0 only for a zero vector, which then decodes to 0 through its zero norm.
                scalars["corr"] = torch.where(nrm > 0, dot, torch.ones_like(dot)).to(
                    torch.float16)
        if self.variant == "prod":
            u = y * inv[:, None]  # the same float32 product the quantizer compared
            if self.mse_bits:
                idx = ops.unpack_bits(packed, self.dim, self.mse_bits, self.backend)
                r = u - self._arr.get("centroids", dev)[idx.long()]
                scalars["rnorm"] = store_norm(torch.linalg.vector_norm(r, dim=1), dt, "rnorm")
            else:
                r = u
            parts.append(sign_pack(r @ self._arr.get("S", dev).T, self.backend))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], scalars

    def _one_call_encode(self, device: torch.device) -> bool:
        """Whether ``encode_block`` runs as one compiled call here: TurboQuant-mse with the
        norm or the fitted scale, a Hadamard rotation, the compiled CPU kernel."""
        return (self.variant == "mse" and self.scale in ("norm", "fit")
                and isinstance(self._rot, HadamardRotation)
                and ops.compiled_cpu("turbo_mse_encode", device, self.backend))

    # -- decode / score ---------------------------------------------------------------------
    def _rotated_unit(self, codes: Codes) -> torch.Tensor:
        """Reconstruction of Pi x / ||x|| in the rotated domain: (B, d) float32."""
        dev = codes.device
        if self.mse_bits:
            idx = ops.unpack_bits(codes.payload[:, : self._mse_bytes], self.dim, self.mse_bits,
                                  self.backend)
            yhat = self._arr.get("centroids", dev)[idx.long()]
        else:
            yhat = torch.zeros((len(codes), self.dim), dtype=torch.float32, device=dev)
        if self.variant == "prod":
            s = signs_pm1(codes.payload[:, self._mse_bytes:], self.sketch_dim, self.backend)
            g = self._gamma(codes) * qjl_scale(self.sketch_dim)
            yhat = yhat + g[:, None] * (s @ self._arr.get("S", dev))
        return yhat

    def _gamma(self, codes: Codes) -> torch.Tensor:
        if self.mse_bits:
            return codes.scalars["rnorm"].float()
        return torch.ones(len(codes), dtype=torch.float32, device=codes.device)

    def decoded_sqnorms(self, codes: Codes) -> torch.Tensor:
        # The rotation is orthogonal: ||x_hat|| = ||x|| * ||y_hat|| in the rotated domain.
        if self.variant == "mse" and self.mse_bits:  # ||y_hat||^2 = sum of squared centroids
            csq, _ = ops.centroid_stats(codes.payload[:, : self._mse_bytes], self.dim,
                                        self.mse_bits, self._arr.get("centroids", codes.device),
                                        backend=self.backend)
            return csq * self.multiplier(codes) ** 2
        return (self._rotated_unit(codes) ** 2).sum(1) * self.multiplier(codes) ** 2

    def decode_block(self, codes: Codes) -> torch.Tensor:
        if self._one_call_decode(codes.device):
            # the steps below in one compiled call (the same bits; ops.turbo_mse_decode)
            rot = self._rot.op(codes.device)
            return ops.turbo_mse_decode(codes.payload, self.multiplier(codes), rot.perms,
                                        rot.signs, rot.p, self._arr.get("centroids", codes.device),
                                        self.mse_bits, self.dim, self.backend)
        y = self._rotated_unit(codes) * self.multiplier(codes)[:, None]
        return self._rot.inverse(y.contiguous())

    def _decode_rows(self, device: torch.device) -> int:
        return 1 << 62 if self._one_call_decode(device) else super()._decode_rows(device)

    def _one_call_decode(self, device: torch.device) -> bool:
        """Whether ``decode_block`` runs as one compiled call here: TurboQuant-mse with a
        Hadamard rotation, the compiled CPU kernel."""
        return (self.variant == "mse" and self.mse_bits > 0
                and isinstance(self._rot, HadamardRotation)
                and ops.compiled_cpu("turbo_mse_decode", device, self.backend))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Pi x for (n, d) float32 rows: the domain the codes live in."""
        return self._rot.apply(x)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Pi^T y for (n, d) float32 rows (back from the rotated domain)."""
        return self._rot.inverse(y.contiguous())

    def kernel_form(self) -> KernelForm | None:
        """mse codes: one term, Pi^T (m c[idx]) (``KernelForm``); prod has a second (QJL)."""
        return self._kernel_form

    @functools.cached_property
    def _kernel_form(self) -> KernelForm | None:  # made once: searches ask for it per block
        if self.variant != "mse":
            return None
        return KernelForm(self.bits, None if self.scale == "unbiased" else
                          ("fit" if self.scale == "fit" else "norm"), self.scale == "norm")

    def query_rotation(self, device: torch.device | str = "cpu") -> ops.HadamardRotate | None:
        """The prepared op on ``device`` that ``query_terms`` rotates queries with (a Hadamard
        rotation; None for Haar), for callers that fuse it into kernel calls (``index.fused``,
        ``ops.attention_step``)."""
        if not isinstance(self._rot, HadamardRotation):
            return None
        return self._rot.op(torch.device(device))

    def query_terms(self, q: torch.Tensor) -> list[torch.Tensor]:
        qr = self._rot.apply(q)
        terms = [qr] if self.mse_bits else []
        if self.variant == "prod":
            terms.append(qr @ self._arr.get("S", q.device).T)
        return terms

    def code_terms(self, codes: Codes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """mse: [(c[idx], m)] with m = ||x|| (or ||x|| / <u, c>): <q, x_hat> = m <Pi q, c[idx]>.
        prod adds [(sign(S r), ||x|| gamma sqrt(pi/2)/m)] paired with S Pi q."""
        dev = codes.device
        nrm = self.multiplier(codes)
        terms = []
        if self.mse_bits:
            idx = ops.unpack_bits(codes.payload[:, : self._mse_bytes], self.dim, self.mse_bits,
                                  self.backend)
            # Centroid values in the rotated domain (never inverse-rotated).
            terms.append((self._arr.get("centroids", dev)[idx.long()], nrm))
        if self.variant == "prod":
            signs = signs_pm1(codes.payload[:, self._mse_bytes:], self.sketch_dim, self.backend)
            terms.append((signs, nrm * self._gamma(codes) * qjl_scale(self.sketch_dim)))
        return terms

    def lut_term_bits(self) -> list[int] | None:
        return ([self.mse_bits] if self.mse_bits else []) + ([1] if self.variant == "prod" else [])

    def _sign_prefix_dims(self) -> int:
        """1-bit codes: the coordinates of their coarse pass, the first half of the code bytes
        (8 per byte; 0 where that would be all of them, d <= 8)."""
        d1 = 8 * ((self._mse_bytes + 1) // 2)
        return d1 if d1 < self.dim else 0

    def has_sign_term(self) -> bool:
        return self.variant == "mse" and (self.mse_bits >= 2 or (
            self.mse_bits == 1 and self._sign_prefix_dims() > 0))

    def sign_term(self, codes: Codes) -> LutTerm | None:
        """The mse codes cut to their top bit, as a ``lut_terms`` entry (packed 1-bit codes, d1,
        1, centroids, multiplier): the coarse first pass of a two-stage scan. The codebook is
        symmetric with a threshold at 0, so the top bit of an index is the sign of the rotated
        coordinate, and the 1-bit Lloyd-Max centroids +-E[|u_j|] are exactly the probability-
        weighted means of the finer cells on each side (d1 = d). 1-bit codes have no coarser
        bit: their pass is the codes of the first d1 = 8 ceil(ceil(d / 8) / 2) coordinates,
        half of the bytes (after the random rotation every coordinate carries the same share of
        <q, x>, so a prefix scores ~d1/d of it with ~d/d1 times the relative noise). None for
        prod, or 1 bit at d <= 8. Its scale: ``sign_scale``."""
        if not self.has_sign_term():
            return None
        b, dev = self.mse_bits, codes.device
        if b == 1:
            d1 = self._sign_prefix_dims()
            packed = codes.payload[:, : d1 // 8].contiguous()
            return LutTerm(packed, d1, 1, self._arr.get("centroids", dev).to(torch.float32),
                           self.sign_scale(codes))
        payload = codes.payload[:, : self._mse_bytes]
        parts = [ops.pack_bits(ops.unpack_bits(payload[s:s + 65536], self.dim, b, self.backend)
                               >> (b - 1), 1, self.backend)
                 for s in range(0, payload.shape[0], 65536)]
        packed = torch.cat(parts) if parts else torch.empty(
            (0, ops.row_bytes(self.dim, 1)), dtype=torch.uint8, device=dev)
        c1 = torch.from_numpy(sphere_codebook(self.dim, 1).centroids.astype(np.float32))
        return LutTerm(packed, self.dim, 1, c1.to(dev), self.sign_scale(codes))

    def sign_scale(self, codes: Codes) -> torch.Tensor:
        """``sign_term``'s per-row scale: the multiplier, but the norm for the unbiased scale
        at 2+ bits - the b-bit codes' ||x|| / <u, c[idx]> would stretch each row's 1-bit
        reconstruction by its own factor (1-bit codes: their prefix is the codes themselves)."""
        if self.scale == "unbiased" and self.mse_bits > 1:
            return codes.scalars["norm"].float()
        return self.multiplier(codes).to(torch.float32)

    def sign_term_error(self) -> SignTermError | None:
        """``Codec.sign_term_error`` at 2+ bits (the sign plane covers every coordinate; 1-bit
        codes' prefix pass has no such model), from the codebook with a rotated coordinate
        y ~ N(0, 1/d). With c the b-bit centroids, c1 the sign term's and s = sign(y), the full
        estimate minus g times the sign estimate is m <q, w>, w = c - g c1 s. A row's own gain
        g = ||c||^2 / (c1 sum |c_j|) makes w orthogonal to c (``sign_term_gains``), so only the
        part of q orthogonal to c, of norm ||q|| sin, meets w: over its ~independent
        coordinates the error has variance (||q|| sin)^2 E[w_j^2] (noise^2 = E[w_j^2]). For
        Lloyd-Max codes g ~ E[c^2] / c1^2 (``gain``), the 1-bit estimate's 2/pi shrinkage undone;
        cnorm = E||c|| for a unit vector."""
        if self.variant != "mse" or self.mse_bits < 2:
            return None
        cb = self.codebook
        sigma = 1.0 / math.sqrt(self.dim)
        edges = [-math.inf, *map(float, cb.thresholds), math.inf]

        def cdf(t: float) -> float:
            return 0.5 * (1.0 + math.erf(t / (sigma * math.sqrt(2.0))))

        cells = [(float(c), cdf(hi) - cdf(lo))
                 for c, lo, hi in zip(cb.centroids, edges[:-1], edges[1:], strict=True)]
        c1 = float(sphere_codebook(self.dim, 1).centroids[1])
        e_c2 = sum(p * c * c for c, p in cells)
        gain = e_c2 / (c1 * sum(p * abs(c) for c, p in cells))
        e_w2 = sum(p * (c - gain * c1 * math.copysign(1.0, c)) ** 2 for c, p in cells)
        return SignTermError(float(gain), math.sqrt(e_w2), math.sqrt(e_c2 * self.dim))

    def sign_term_gains(self, codes: Codes) -> torch.Tensor:
        if self.sign_term_error() is None:
            raise ValueError(f"{self!r} has no sign-term error model (mse codes at 2+ bits)")
        packed, dev = codes.payload[:, : self._mse_bytes], codes.device
        cents = self._arr.get("centroids", dev).to(torch.float32)
        csq, _ = ops.centroid_stats(packed, self.dim, self.mse_bits, cents, backend=self.backend)
        # sum_j |c_j| as the "squares" of sqrt|c|
        cabs, _ = ops.centroid_stats(packed, self.dim, self.mse_bits, cents.abs().sqrt(),
                                     backend=self.backend)
        c1 = float(sphere_codebook(self.dim, 1).centroids[1])
        return torch.where(cabs > 0, csq / (c1 * cabs), torch.ones_like(csq))

    def lut_terms(self, codes: Codes) -> list[LutTerm]:
        """code_terms over the packed codes (no unpacking): the mse indices with the codebook,
        and for prod the QJL sign bits with centroids (-1, +1)."""
        dev = codes.device
        nrm = self.multiplier(codes).to(torch.float32)
        terms = []
        if self.mse_bits:
            terms.append(LutTerm(codes.payload[:, : self._mse_bytes], self.dim, self.mse_bits,
                                 self._arr.get("centroids", dev), nrm))
        if self.variant == "prod":
            terms.append(LutTerm(codes.payload[:, self._mse_bytes:], self.sketch_dim, 1,
                                 torch.tensor([-1.0, 1.0], device=dev),
                                 (nrm * self._gamma(codes) * qjl_scale(self.sketch_dim)).float()))
        return terms

