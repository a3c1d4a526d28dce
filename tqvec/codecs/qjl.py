"""QJL (Zandieh, Daliri, Han 2024): k -> (sign(S k), ||k||), m sign bits + one norm.

Estimator (QJL paper, Eq. (4)): <q, k> ~ sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>, unbiased for
Gaussian S and for orthogonalized rows scaled by E[chi_d] (tqvec.random.jl_row_scale).

Outlier channels (QJL paper, Section 4.1): a fixed set O of channels is split off and sketched
by an independent QJL instance with more bits per coordinate; then
<q, k> = <q_I, k_I> + <q_O, k_O>, each part estimated with its own matrix and norm. The
channels are a parameter (the codec stays fit-free); ``top_channels`` picks them from data, e.g.
from a prefill, as the paper does.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..random import JL_KINDS, JL_VERSION, JL_VERSIONS, jl_check, jl_matrix, jl_work
from ._common import DeviceCache, qjl_scale, sign_pack, signs_pm1
from .base import NORM_DTYPES, Codec, Codes, LutTerm, register, store_norm

__all__ = ["QJL", "top_channels"]


def top_channels(x: Any, count: int) -> list[int]:
    """The ``count`` channels of x (n, d) with the largest mean squared magnitude."""
    t, _ = V.float_matrix(x, "x", allow_empty=False)
    count = V.positive_int(count, "count", 0, t.shape[1] - 1)
    energy = (t.float() ** 2).mean(0)
    return sorted(int(i) for i in torch.topk(energy, count).indices)


@register
class QJL(Codec):
    """QJL key quantizer.

    Parameters
    ----------
    dim: vector dimension d >= 2.
    sketch_dim: sign bits m per vector for the (inlier) channels (default d).
    seed: fixes the JL matrices.
    jl: ``"orthogonal"`` (default; lower variance, QJL paper Section 4) or ``"gaussian"``.
    outliers: channel indices quantized by a separate QJL instance (default none).
    outlier_sketch_dim: sign bits for the outlier part (default 8 per outlier channel).
    norm_dtype: ``"float32"`` or ``"float16"``.
    jl_version: as ``TurboQuant``'s (the orthogonal draw of a sketch with fewer rows than
        channels).
    """

    name = "qjl"

    def __init__(self, dim: int, sketch_dim: int | None = None, seed: int = 0, *,
                 jl: str = "orthogonal", outliers: Any = (), outlier_sketch_dim: int | None = None,
                 norm_dtype: str = "float32", jl_version: int = JL_VERSION,
                 backend: str = "auto"):
        self.dim = V.positive_int(dim, "dim", 2, V.MAX_DIM)
        self.sketch_dim = (self.dim if sketch_dim is None
                           else V.positive_int(sketch_dim, "sketch_dim", 1, V.MAX_DIM))
        self.seed = V.seed(seed)
        self.jl = V.choice(jl, "jl", JL_KINDS)
        self.jl_version = V.positive_int(jl_version, "jl_version", 1, max(JL_VERSIONS))
        self.norm_dtype = V.choice(norm_dtype, "norm_dtype", tuple(NORM_DTYPES))
        self.backend = V.choice(backend, "backend", ops.BACKENDS)
        if isinstance(outliers, (str, bytes)) or not hasattr(outliers, "__iter__"):
            raise TypeError(f"outliers must be a sequence of channel indices, got {outliers!r}")
        out = sorted({V.positive_int(i, "outliers[i]", minimum=-V.INT64_MAX) for i in outliers})
        if out and (out[0] < 0 or out[-1] >= self.dim):
            raise ValueError(f"outliers must be channel indices in 0..{self.dim - 1}, got {out}")
        if len(out) > self.dim - 2:
            raise ValueError(f"outliers must leave at least 2 inlier channels, got {len(out)} "
                             f"of {self.dim}")
        self.outliers = out
        if out:
            self.outlier_sketch_dim = (V.positive_int(outlier_sketch_dim, "outlier_sketch_dim", 1,
                                                       V.MAX_DIM)
                                       if outlier_sketch_dim else 8 * len(out))
        elif outlier_sketch_dim:
            raise ValueError("outlier_sketch_dim must be None without outliers, got "
                             f"{outlier_sketch_dim}")
        else:
            self.outlier_sketch_dim = 0
        # the matrices' sizes are refused now; they are drawn at first use
        jl_check(self.sketch_dim, self.dim - len(out), self.jl, self.jl_version)
        if out:
            jl_check(self.outlier_sketch_dim, len(out), self.jl, self.jl_version)
        self._in_bytes = ops.row_bytes(self.sketch_dim, 1)
        self._out_bytes = ops.row_bytes(self.outlier_sketch_dim, 1) if out else 0

    @functools.cached_property
    def _arr(self) -> DeviceCache:
        out = np.asarray(self.outliers, dtype=np.int64)
        inl = np.setdiff1d(np.arange(self.dim), out)
        arrays = {"S": jl_matrix(self.sketch_dim, len(inl), self.seed, self.jl,
                                 purpose="qjl", version=self.jl_version).astype(np.float32),
                  "inliers": inl.astype(np.int64)}
        if self.outliers:
            arrays["S_out"] = jl_matrix(self.outlier_sketch_dim, len(out), self.seed, self.jl,
                                        purpose="qjl.outliers",
                                        version=self.jl_version).astype(np.float32)
            arrays["outliers"] = out
        return DeviceCache(**arrays)

    @property
    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"codec": self.name, "dim": self.dim, "sketch_dim": self.sketch_dim,
                             "seed": self.seed, "jl": self.jl, "norm_dtype": self.norm_dtype}
        if self.outliers:
            p["outliers"] = list(self.outliers)
            p["outlier_sketch_dim"] = self.outlier_sketch_dim
        if self.jl == "orthogonal" and self.jl_version > 1 and (
                self.sketch_dim < self.dim - len(self.outliers)
                or (self.outliers and self.outlier_sketch_dim < len(self.outliers))):
            # the draws differ only for m < d; absent: version 1 (files written before)
            p["jl_version"] = self.jl_version
        return p

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> QJL:
        return cls(**{"jl_version": 1, **params})  # absent: written before version 2

    @property
    def payload_bytes(self) -> int:
        return self._in_bytes + self._out_bytes

    def _scalar_layout(self):
        dt = NORM_DTYPES[self.norm_dtype]
        lay = {"norm": ((), dt)}
        if self.outliers:
            lay["onorm"] = ((), dt)
        return lay

    def fingerprint_arrays(self):
        return [a.numpy() for a in self._arr.host.values()]

    def draw_work(self) -> int:
        n_out = len(self.outliers)
        work = jl_work(self.sketch_dim, self.dim - n_out, self.jl, self.jl_version) + self.dim
        if n_out:
            work += jl_work(self.outlier_sketch_dim, n_out, self.jl, self.jl_version)
        return work

    unbiased_ip = True

    def true_sqnorms(self, codes: Codes) -> torch.Tensor:
        sq = codes.scalars["norm"].float() ** 2
        if self.outliers:
            sq = sq + codes.scalars["onorm"].float() ** 2
        return sq

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.outliers:
            return x, None
        return (x[:, self._arr.get("inliers", x.device)],
                x[:, self._arr.get("outliers", x.device)])

    def encode_block(self, x: torch.Tensor, nrm: torch.Tensor):
        dt = NORM_DTYPES[self.norm_dtype]
        xi, xo = self._split(x)
        if xo is not None:
            nrm = torch.linalg.vector_norm(xi, dim=1)
        parts = [sign_pack(xi @ self._arr.get("S", x.device).T, self.backend)]
        scalars = {"norm": store_norm(nrm, dt)}
        if xo is not None:
            onrm = torch.linalg.vector_norm(xo, dim=1)
            parts.append(sign_pack(xo @ self._arr.get("S_out", x.device).T, self.backend))
            scalars["onorm"] = store_norm(onrm, dt, "onorm")
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], scalars

    def _parts(self, codes: Codes):
        """(signs, scaled norms, JL matrix) for the inlier and (if any) outlier sketch."""
        dev = codes.device
        yield (signs_pm1(codes.payload[:, : self._in_bytes], self.sketch_dim, self.backend),
               codes.scalars["norm"].float() * qjl_scale(self.sketch_dim), self._arr.get("S", dev))
        if self.outliers:
            yield (signs_pm1(codes.payload[:, self._in_bytes:], self.outlier_sketch_dim,
                             self.backend),
                   codes.scalars["onorm"].float() * qjl_scale(self.outlier_sketch_dim),
                   self._arr.get("S_out", dev))

    def decode_block(self, codes: Codes) -> torch.Tensor:
        parts = [(s @ S) * g[:, None] for s, g, S in self._parts(codes)]
        if not self.outliers:
            return parts[0]
        out = torch.empty((len(codes), self.dim), dtype=torch.float32, device=codes.device)
        out[:, self._arr.get("inliers", codes.device)] = parts[0]
        out[:, self._arr.get("outliers", codes.device)] = parts[1]
        return out

    def query_terms(self, q: torch.Tensor) -> list[torch.Tensor]:
        qi, qo = self._split(q)
        terms = [qi @ self._arr.get("S", q.device).T]
        if qo is not None:
            terms.append(qo @ self._arr.get("S_out", q.device).T)
        return terms

    def code_terms(self, codes: Codes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(s, g) for s, g, _ in self._parts(codes)]

    def lut_term_bits(self) -> list[int] | None:
        return [1, 1] if self.outliers else [1]

    def lut_terms(self, codes: Codes) -> list[LutTerm]:
        """The sign bits as 1-bit codes with centroids (-1, +1), scaled as in code_terms."""
        dev = codes.device
        pm1 = torch.tensor([-1.0, 1.0], device=dev)
        terms = [LutTerm(codes.payload[:, : self._in_bytes], self.sketch_dim, 1, pm1,
                         (codes.scalars["norm"].float() * qjl_scale(self.sketch_dim)))]
        if self.outliers:
            terms.append(LutTerm(codes.payload[:, self._in_bytes:], self.outlier_sketch_dim, 1,
                                 pm1, codes.scalars["onorm"].float()
                                 * qjl_scale(self.outlier_sketch_dim)))
        return terms
