"""Optimal scalar codebooks for the distributions that data-oblivious quantizers create.

* ``sphere_codebook(d, b)``: Lloyd-Max for one coordinate of a uniform point on S^{d-1}, the
  density f(x) ∝ (1 - x^2)^((d-3)/2) on [-1, 1] (TurboQuant paper, Lemma 1; a rescaled
  Beta((d-1)/2, (d-1)/2)), for any d >= 2 and b = 1..8.
* ``sphere_grid_codebook(d, b)``: the best *uniform grid* for the same coordinate law: centroids
  (i - (K-1)/2) * step, thresholds at the midpoints, the step chosen to minimize the MSE. It
  costs distortion against Lloyd-Max (d = 784: 0.1186 vs 0.1172 at 2 bits, 8.7e-5 vs 4.1e-5 at 8;
  identical at 1 bit, where every symmetric 2-level codebook is a grid), but an index decodes
  affinely, c[i] = (step / 2) (2 i - K + 1): a kernel scores a row with integer-to-float
  conversions and multiplies instead of a table gather per coordinate (an 8-bit refinement).
* ``angle_codebook(level, b)``: Lloyd-Max for the PolarQuant angle of a given level of the
  recursive polar transform of a Gaussian vector (PolarQuant paper, Lemma 2): level 1 uniform on
  [0, 2pi) (a circle, so the optimum is the uniform partition), level l >= 2 with density
  ∝ sin^(k-1)(2 psi) on [0, pi/2], k = 2^(l-1) (two independent chi_k radii).
* ``gaussian_codebook(d, b)``: the N(0, 1/d) approximation, only as a cross-check.
* ``sphere_block_codebook(d, b, block)``: a vector codebook (2^(b * block) points in R^block)
  for ``block`` consecutive coordinates of a uniform point on S^{d-1}, by Lloyd's algorithm on a
  fixed seeded sample (no closed form in several dimensions). Coding coordinates jointly gains
  what a scalar quantizer cannot (cells that are not boxes): at d = 64, 2 bits, blocks of 4 cut
  the MSE from 0.117 to ~0.097.

Integrals are done in an angle variable where every density is a smooth power of a cosine:
x = sin(theta) gives f(x) dx ∝ cos^(d-2)(theta) d theta (smooth even for d = 2, the arcsine law),
and psi = pi/4 + theta/2 gives sin^(k-1)(2 psi) = cos^(k-1)(theta). Each cell is integrated with
128-point Gauss-Legendre quadrature on the part of the support where the density exceeds
e^-80 of its peak. The pseudocode's Gaussian centroid formula multiplies by sigma twice; the
conditional mean of N(0, s^2) on [a, b] is s (phi(a/s) - phi(b/s)) / (Phi(b/s) - Phi(a/s)), which
is what ``gaussian_codebook`` uses. Its reference MSE figures (0.092, 0.023 at b = 2, 3) are wrong
too; the exact values are 0.1160 and 0.0340 (tests/bounds.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Codebook", "sphere_codebook", "sphere_grid_codebook", "grid_half_step",
           "angle_codebook", "gaussian_codebook", "polar_expected_mse", "BlockCodebook",
           "sphere_block_codebook"]

_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(128)


@dataclass(frozen=True)
class Codebook:
    """A scalar quantizer: value v maps to index #{t : thresholds[t] <= v}.

    centroids: (K,) float64 ascending; thresholds: (K-1,) float64 ascending (cell boundaries).
    mse: expected squared error (for sphere codebooks: of a unit vector, i.e. d times the
    per-coordinate cost; for angle codebooks: per angle). expected_cos: E[cos(v - Q(v))] (angle
    codebooks only, used to predict PolarQuant's MSE).
    """

    centroids: np.ndarray
    thresholds: np.ndarray
    mse: float
    expected_cos: float = float("nan")
    iterations: int = 0

    @property
    def bits(self) -> int:
        return int(round(math.log2(len(self.centroids))))


class _CosPower:
    """Density ∝ cos^e(theta) on [-T, T] with value map v(theta) = a + s*sin or a + s*theta."""

    def __init__(self, e: float, value: str, a: float = 0.0, s: float = 1.0):
        self.e, self.value_kind, self.a, self.s = e, value, a, s
        # Support where cos^e > exp(-80): (1 - theta^2/2)^e ~ exp(-e theta^2 / 2).
        self.T = math.pi / 2 if e <= 0 else min(math.pi / 2, math.sqrt(160.0 / e))

    def v(self, th):
        return self.a + self.s * (np.sin(th) if self.value_kind == "sin" else th)

    def v_inv(self, v):
        u = np.clip((np.asarray(v) - self.a) / self.s, -np.inf, np.inf)
        if self.value_kind == "sin":
            return np.arcsin(np.clip(u, -1.0, 1.0))
        return u

    def w(self, th):
        c = np.clip(np.cos(th), 1e-300, None)
        return np.exp(self.e * np.log(c)) if self.e != 0 else np.ones_like(th)

    def density_v(self, th):
        """Unnormalized density in the value variable (consistent with ``cells`` weights)."""
        th = np.clip(th, -self.T, self.T)
        dv = self.s * (np.cos(th) if self.value_kind == "sin" else np.ones_like(th))
        inside = np.abs(th) < self.T
        return np.where(inside, self.w(th) / np.maximum(dv, 1e-300), 0.0)

    def cells(self, lo, hi):
        """Quadrature nodes and weights on each cell [lo_i, hi_i] (theta), clipped to support."""
        lo = np.clip(lo, -self.T, self.T)
        hi = np.clip(hi, -self.T, self.T)
        half = (hi - lo)[:, None] / 2
        th = half * _NODES[None, :] + ((hi + lo) / 2)[:, None]
        return th, half * _WEIGHTS[None, :] * self.w(th)


def _lloyd_max(dist: _CosPower, init: np.ndarray, vmin: float, vmax: float,
               tol: float, max_iter: int = 200) -> Codebook:
    """Solve the Lloyd-Max conditions c_i = E[v | cell_i] (cells bounded by centroid midpoints).

    Plain Lloyd iteration converges linearly and needs ~1e5 sweeps at b = 8; instead this runs
    Newton on F(c) = c - L(c), whose Jacobian is tridiagonal and known in closed form:
    d mu/d b = f(b) (b - mu) / P and d mu/d a = f(a) (mu - a) / P for the conditional mean mu
    of a cell [a, b] of probability P, with each boundary the midpoint of its two centroids.
    A step that would unsort the centroids or raise the distortion is halved.
    """
    def lloyd(c):
        t = (c[:-1] + c[1:]) / 2
        edges_v = np.concatenate([[vmin], t, [vmax]])
        edges = dist.v_inv(edges_v)
        th, wq = dist.cells(edges[:-1], edges[1:])
        m0 = np.maximum(wq.sum(1), 1e-300)
        mu = (wq * dist.v(th)).sum(1) / m0
        err = (wq * (dist.v(th) - c[:, None]) ** 2).sum()
        return edges_v, edges, m0, mu, err

    c = np.sort(np.asarray(init, dtype=np.float64))
    K = len(c)
    it = 0
    while it < max_iter:
        it += 1
        edges_v, edges, m0, mu, err = lloyd(c)
        resid = c - mu
        if np.max(np.abs(resid)) < tol:
            break
        fv = dist.density_v(edges)  # density in the value variable at every edge
        lo_term = 0.5 * fv[:-1] * (mu - edges_v[:-1]) / m0  # via the lower boundary
        hi_term = 0.5 * fv[1:] * (edges_v[1:] - mu) / m0  # via the upper boundary
        lo_term[0] = 0.0  # the outer edges are fixed
        hi_term[-1] = 0.0
        jac = np.diag(1.0 - lo_term - hi_term)
        jac[np.arange(1, K), np.arange(K - 1)] = -lo_term[1:]
        jac[np.arange(K - 1), np.arange(1, K)] = -hi_term[:-1]
        step = np.linalg.solve(jac, -resid)
        lam = 1.0
        while lam > 1e-4:
            trial = c + lam * step
            if np.all(np.diff(trial) > 0) and lloyd(trial)[4] <= err * (1 + 1e-12):
                break
            lam /= 2
        c = trial if lam > 1e-4 else mu  # fall back to a plain Lloyd step
    t = (c[:-1] + c[1:]) / 2
    edges = dist.v_inv(np.concatenate([[vmin], t, [vmax]]))
    th, wq = dist.cells(edges[:-1], edges[1:])
    z = wq.sum()
    err = (wq * (dist.v(th) - c[:, None]) ** 2).sum() / z
    ecos = (wq * np.cos(dist.v(th) - c[:, None])).sum() / z
    return Codebook(centroids=c, thresholds=t, mse=float(err), expected_cos=float(ecos),
                    iterations=it)


def _compander_init(dist: _CosPower, K: int) -> np.ndarray:
    """High-resolution initial guess: centroids at quantiles of the point density ∝ f^(1/3)."""
    th = np.linspace(-dist.T, dist.T, 20001)
    dens = dist.w(th) ** (1.0 / 3.0)
    if dist.value_kind == "sin":
        dens = dens * np.cos(th) ** (2.0 / 3.0)  # f_x^(1/3) dx with dx = cos(theta) d theta
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2)])
    cdf /= cdf[-1]
    return dist.v(np.interp((np.arange(K) + 0.5) / K, cdf, th))


def _symmetrize(cb: Codebook, centre: float) -> Codebook:
    """Exact mirror symmetry about ``centre`` (so the middle threshold is exactly ``centre``)."""
    c = cb.centroids - centre
    c = (c - c[::-1]) / 2 + centre
    t = (c[:-1] + c[1:]) / 2
    if len(t) % 2 == 1:
        t[len(t) // 2] = centre
    return Codebook(centroids=c, thresholds=t, mse=cb.mse, expected_cos=cb.expected_cos,
                    iterations=cb.iterations)


def _check_bits(b: int) -> None:
    if not isinstance(b, (int, np.integer)) or not 1 <= int(b) <= 8:
        raise ValueError(f"bits must be in 1..8, got {b!r}")


@functools.lru_cache(maxsize=256)
def sphere_codebook(d: int, b: int) -> Codebook:
    """Lloyd-Max codebook for a coordinate of a uniform point on S^{d-1}; ``mse`` = d * cost,
    the expected ||x - x_hat||^2 of TurboQuant-mse on a unit vector (Theorem 1)."""
    if not isinstance(d, (int, np.integer)) or d < 2:
        raise ValueError(f"dim must be an int >= 2, got {d!r}")
    _check_bits(b)
    dist = _CosPower(d - 2, "sin")
    K = 1 << b
    cb = _lloyd_max(dist, _compander_init(dist, K), -1.0, 1.0, tol=1e-13 / math.sqrt(d))
    cb = _symmetrize(cb, 0.0)
    return Codebook(cb.centroids, cb.thresholds, mse=cb.mse * d, iterations=cb.iterations)


def _grid_mse(dist: _CosPower, K: int, half_step: float) -> float:
    """E (v - Q(v))^2 of the grid c_i = half_step (2 i - K + 1), cells split at the midpoints."""
    c = half_step * (2.0 * np.arange(K) - (K - 1))
    edges = dist.v_inv(np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2, [1.0]]))
    th, wq = dist.cells(edges[:-1], edges[1:])
    return float((wq * (dist.v(th) - c[:, None]) ** 2).sum() / wq.sum())


def grid_half_step(centroids: np.ndarray) -> float:
    """step / 2 if ``centroids`` (float32) are exactly the grid (step / 2) (2 i - K + 1) with
    K >= 2, else 0.0: the test a kernel's affine decode relies on (tqvec/ops)."""
    c = np.asarray(centroids, dtype=np.float32)
    K = len(c)
    if K < 2 or K % 2:
        return 0.0
    hs = c[K // 2]  # (2 (K/2) - K + 1) = 1: exactly the half step
    want = (np.float64(hs) * (2.0 * np.arange(K) - (K - 1))).astype(np.float32)
    return float(hs) if hs > 0 and np.array_equal(c, want) else 0.0


@functools.lru_cache(maxsize=256)
def sphere_grid_codebook(d: int, b: int) -> Codebook:
    """MSE-optimal uniform grid for a coordinate of a uniform point on S^{d-1}: centroids
    hs (2 i - K + 1), hs (half the step) a float32 number, so the float32 table is exactly that
    grid (``grid_half_step`` recognizes it); thresholds at the midpoints; ``mse`` = d * cost.

    The cost is unimodal in the step here (a log-concave density): a log-spaced scan brackets
    the minimum, golden-section search narrows it to ~1e-9 relative.
    """
    if not isinstance(d, (int, np.integer)) or d < 2:
        raise ValueError(f"dim must be an int >= 2, got {d!r}")
    _check_bits(b)
    dist = _CosPower(d - 2, "sin")
    K = 1 << b
    # The outermost centroid (K - 1) hs lies between 0.1 and ~12 coordinate standard deviations
    # (1 / sqrt(d)); the grid clips past it.
    top = np.exp(np.linspace(math.log(0.1), math.log(12.0), 200)) / math.sqrt(d)
    hs_scan = np.minimum(top / (K - 1), 1.0 / (K - 1))
    cost = [_grid_mse(dist, K, h) for h in hs_scan]
    i = int(np.argmin(cost))
    lo, hi = hs_scan[max(i - 1, 0)], hs_scan[min(i + 1, len(hs_scan) - 1)]
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(60):
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if _grid_mse(dist, K, x1) < _grid_mse(dist, K, x2):
            hi = x2
        else:
            lo = x1
    hs = float(np.float32((lo + hi) / 2))
    c = hs * (2.0 * np.arange(K) - (K - 1))
    t = (c[:-1] + c[1:]) / 2
    t[K // 2 - 1] = 0.0  # exactly the sign (it is 0 up to rounding already)
    return Codebook(c, t, mse=_grid_mse(dist, K, hs) * d)


@functools.lru_cache(maxsize=64)
def angle_codebook(level: int, b: int) -> Codebook:
    """Lloyd-Max codebook for a PolarQuant angle of ``level`` (1-based), ``b`` bits."""
    if not isinstance(level, (int, np.integer)) or level < 1:
        raise ValueError(f"level must be an int >= 1, got {level!r}")
    _check_bits(b)
    K = 1 << b
    if level == 1:
        # Uniform on the circle: the uniform partition is optimal; E cos = sinc(pi/K).
        w = 2 * math.pi / K
        c = (np.arange(K) + 0.5) * w
        t = (np.arange(1, K)) * w
        return Codebook(c, t, mse=w * w / 12, expected_cos=math.sin(w / 2) / (w / 2))
    k = 2 ** (level - 1)
    dist = _CosPower(k - 1, "lin", a=math.pi / 4, s=0.5)
    cb = _lloyd_max(dist, _compander_init(dist, K), 0.0, math.pi / 2, tol=1e-14)
    return _symmetrize(cb, math.pi / 4)


@functools.lru_cache(maxsize=64)
def gaussian_codebook(d: int, b: int) -> Codebook:
    """Lloyd-Max for N(0, 1/d) (the large-d approximation); a cross-check only."""
    from math import erf, exp, pi, sqrt

    _check_bits(b)
    s = 1 / math.sqrt(d)
    K = 1 << b
    phi = np.vectorize(lambda z: exp(-z * z / 2) / sqrt(2 * pi))
    Phi = np.vectorize(lambda z: 0.5 * (1 + erf(z / sqrt(2))))
    c = np.linspace(-2.5, 2.5, K)
    for _ in range(20000):
        t = np.concatenate([[-np.inf], (c[:-1] + c[1:]) / 2, [np.inf]])
        num = phi(t[:-1]) - phi(t[1:])
        den = Phi(t[1:]) - Phi(t[:-1])
        new = num / den
        if np.max(np.abs(new - c)) < 1e-13:
            c = new
            break
        c = new
    t = (c[:-1] + c[1:]) / 2
    tt = np.concatenate([[-np.inf], t, [np.inf]])
    p = Phi(tt[1:]) - Phi(tt[:-1])
    mse = 1.0 - float((p * c * c).sum())  # per unit-variance coordinate; times d * s^2 = 1
    return Codebook(c * s, t * s, mse=mse)


def polar_expected_mse(level_bits: tuple[int, ...]) -> float:
    """Predicted E||x - x_hat||^2 / ||x||^2 of PolarQuant with exact final radii.

    With independent angles (PolarQuant Lemma 2), E<x, x_hat> = ||x||^2 prod_l E[cos(psi_l -
    Q_l(psi_l))] level by level, and ||x_hat|| = ||x||, so the MSE is 2 (1 - prod_l rho_l).
    """
    rho = 1.0
    for level, b in enumerate(level_bits, start=1):
        rho *= angle_codebook(level, b).expected_cos
    return 2.0 * (1.0 - rho)


@dataclass(frozen=True)
class BlockCodebook:
    """A vector quantizer for blocks of ``block`` coordinates: points (K, block) float32; a
    block maps to its nearest point. mse: expected ||x - x_hat||^2 of a unit vector coded block
    by block (d times the per-coordinate cost), measured on a second seeded sample."""

    points: np.ndarray
    block: int
    mse: float


@functools.lru_cache(maxsize=32)
def sphere_block_codebook(d: int, b: int, block: int) -> BlockCodebook:
    """Lloyd's algorithm (k-means) for ``block`` coordinates of a uniform point on S^{d-1} at
    ``b`` bits per coordinate (K = 2^(b * block) <= 256 points): 40 iterations on 64 K block
    samples drawn with a fixed seed, started from the product of the scalar Lloyd-Max codebook
    (``sphere_codebook``). Deterministic on a machine; computed once per process (~2 s for
    256 points)."""
    import torch

    if not isinstance(d, (int, np.integer)) or d < 2:
        raise ValueError(f"dim must be an int >= 2, got {d!r}")
    if block not in (1, 2, 4, 8) or d % block:
        raise ValueError(f"block must be 1, 2, 4 or 8 and divide dim={d}, got {block!r}")
    _check_bits(b)
    K = 1 << (b * block)
    if K > 256:
        raise ValueError(f"bits * block must be <= 8 (at most 256 points), got {b} * {block}")
    g = torch.Generator().manual_seed(0x7B10C + 131 * d + 17 * b + block)

    def sample(n_blocks: int) -> torch.Tensor:
        rows = -(-n_blocks * block // d)
        x = torch.randn(rows, d, generator=g, dtype=torch.float64)
        x = x / torch.linalg.vector_norm(x, dim=1, keepdim=True)
        return x.reshape(-1, block)[:n_blocks]

    def nearest(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = (x * x).sum(1, keepdim=True) - 2 * x @ c.T + (c * c).sum(1)[None]
        best, idx = dist.min(1)
        return idx, best.clamp_min(0)

    train = sample(64 * K)
    # start from the scalar Lloyd-Max grid's product (a good, symmetric start), then iterate
    sc = torch.tensor(sphere_codebook(d, b).centroids)
    grids = torch.meshgrid(*([sc] * block), indexing="ij")
    c = torch.stack([t.reshape(-1) for t in grids], dim=1)
    # the symmetric product is a fixed point of Lloyd's step (pairs at d = 256 stay there):
    # a seeded jitter of a quarter of the scalar spacing lets the cells turn into non-boxes
    gap = float((sc[1:] - sc[:-1]).min()) if len(sc) > 1 else 1.0
    c = c + 0.25 * gap * torch.randn(c.shape, generator=g, dtype=c.dtype)
    t32 = train.float()
    for _ in range(40):
        idx, _ = nearest(t32, c.float())
        cnt = torch.bincount(idx, minlength=K).to(train.dtype)
        tot = torch.zeros_like(c).index_add_(0, idx, train)
        empty = cnt == 0
        c = torch.where(empty[:, None], c, tot / cnt.clamp_min(1)[:, None])
    _, err = nearest(sample(64 * K), c)
    return BlockCodebook(c.float().numpy(), block, float(err.mean()) * d / block)
