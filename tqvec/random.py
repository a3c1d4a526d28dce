"""Seeded random structures: rotations and JL matrices.

Everything is generated on the CPU with numpy's PCG64 from ``(seed, purpose)``, so the same seed
gives the same matrix on every device and backend; the result is cached and moved to the device
on demand. Files record a fingerprint of the materialized arrays (``fingerprint``), so a file can
never silently decode with a different rotation.
"""

from __future__ import annotations

import functools
import hashlib
import math
import zlib

import numpy as np
import torch

from . import _validate as V
from . import ops

__all__ = [
    "ROTATIONS",
    "JL_KINDS",
    "jl_work",
    "rotation_work",
    "Rotation",
    "HaarRotation",
    "HadamardRotation",
    "make_rotation",
    "haar_matrix",
    "jl_matrix",
    "jl_row_scale",
    "JL_VERSION",
    "JL_VERSIONS",
    "haar_frame",
    "check_dense",
    "jl_check",
    "haar_check",
    "generator",
]

ROTATIONS = ("hadamard", "haar")
JL_KINDS = ("orthogonal", "gaussian")


def generator(seed: int, purpose: str, *extra: int) -> np.random.Generator:
    """An independent stream for each ``(seed, purpose, *extra)``."""
    key = (zlib.crc32(purpose.encode()),) + tuple(int(e) for e in extra)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def check_dense(rows: int, cols: int, what: str) -> None:
    """Refuse a dense random matrix beyond ``MAX_DENSE`` elements before drawing it."""
    if rows * cols > V.MAX_DENSE:
        raise ValueError(f"{what} must have at most {V.MAX_DENSE} elements (a dense random "
                         f"matrix), got {rows} x {cols}")


def qr_work_check(d: int, m: int, draws: int, message: str) -> None:
    """Refuse orthogonal draws whose QR work (draws d m^2) exceeds ``MAX_QR_WORK``."""
    if draws * d * m * m > V.MAX_QR_WORK:
        raise ValueError(f"{message} (orthogonalization work {draws * d * m * m:.3g} > "
                         f"{V.MAX_QR_WORK:.3g} = 2**36 multiply-adds)")


def haar_matrix(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-distributed orthogonal (d, d) float64 matrix: QR of a Gaussian with the sign fix
    (multiplying column j of Q by sign(R_jj) makes the distribution exactly Haar)."""
    return haar_frame(d, d, rng)


def haar_frame(d: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """(d, m) float64 with orthonormal columns, distributed as the first m columns of a Haar
    matrix: reduced QR of a (d, m) Gaussian with the sign fix; O(d m) memory, O(d m^2) time."""
    check_dense(d, m, "a Haar draw")
    qr_work_check(d, m, 1, f"a Haar draw of {d} x {m} is too large")
    g = rng.standard_normal((d, m))
    q, r = np.linalg.qr(g)
    s = np.sign(np.diag(r))
    s[s == 0] = 1.0
    return q * s[None, :]


def jl_row_scale(d: int) -> float:
    """Norm given to each row of an orthogonalized JL matrix: E[chi_d] = sqrt(2) G((d+1)/2)/G(d/2).

    With rows s_i = c * u_i (u_i uniform on the sphere), E[|s_i.k|] = c ||k|| E|u_1| and the QJL
    estimator sqrt(pi/2)/m ||k|| <Sq, sign(Sk)> (QJL paper, Eq. (4)) is unbiased exactly when
    c = 1 / (sqrt(pi/2) E|u_1|) = E[chi_d], the mean norm of a Gaussian row. Unit rows (the QJL
    reference code's QR output) are biased by a factor ~1/sqrt(d); sqrt(d) is off by O(1/d).
    """
    return math.sqrt(2.0) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))


#: Versions of the orthogonal JL draw. They differ only for m < d: version 1 took the first m
#: rows of a d x d Haar matrix (O(d^2) memory: 32 GiB for d = 65,536), version 2 draws the m
#: orthonormal rows directly (``haar_frame``, O(m d)); the rows have the same law. Codecs
#: record the version in their params where it matters (m < d) so that older files keep
#: decoding with the matrix they were written with.
JL_VERSIONS = (1, 2)
JL_VERSION = 2


def haar_check(d: int) -> None:
    """What a Haar rotation of R^d would refuse, checked without drawing."""
    qr_work_check(d, d, 1, f"dim must be at most 4096 for rotation='haar', got {d}: use "
                           "rotation='hadamard' (O(d log d), no matrix)")


def jl_check(m: int, d: int, kind: str = "orthogonal", version: int = JL_VERSION) -> None:
    """What ``jl_matrix`` would refuse, checked without drawing: the kind, and the dense
    matrices it builds (m x d; a version-1 orthogonal draw with m < d builds d x d)."""
    if kind not in JL_KINDS:
        raise ValueError(f"jl must be one of {list(JL_KINDS)}, got {kind!r}")
    check_dense(m, d, "a JL matrix (sketch_dim x dim)")
    if kind == "orthogonal":
        if m < d and version < 2:  # the first m rows of a d x d Haar matrix
            check_dense(d, d, "a version-1 JL draw (dim x dim)")
            draws, cols = 1, d
        elif m < d:
            draws, cols = 1, m
        else:  # ceil(m / d) stacked d x d Haar blocks
            draws, cols = -(-m // d), d
        qr_work_check(d, cols, draws, f"sketch_dim={m} with dim={d} and jl='orthogonal' is too "
                                      "large: use jl='gaussian' (no orthogonalization) or a "
                                      "smaller sketch_dim")


def jl_work(m: int, d: int, kind: str = "orthogonal", version: int = JL_VERSION) -> int:
    """What drawing ``jl_matrix(m, d, ...)`` costs, in elements drawn plus QR multiply-adds,
    computed without drawing (a file reader compares it with the file's size)."""
    if kind == "gaussian":
        return m * d
    if m < d and version < 2:
        return d * d + d ** 3
    if m < d:
        return d * m + d * m * m
    return -(-m // d) * (d * d + d ** 3)


def rotation_work(kind: str, d: int, rounds: int = 3) -> int:
    """What drawing ``make_rotation(kind, d, ...)`` costs, in the units of ``jl_work``."""
    return d * d + d ** 3 if kind == "haar" else 2 * rounds * d


def jl_matrix(m: int, d: int, seed: int, kind: str = "orthogonal", purpose: str = "jl",
              version: int = JL_VERSION) -> np.ndarray:
    """A JL matrix S (m, d) float64 for which sqrt(pi/2)/m * ||k|| * <Sq, sign(Sk)> is unbiased.

    ``gaussian``: i.i.d. N(0, 1) entries (QJL Definition 3.1). ``orthogonal``: rows of independent
    Haar blocks (m > d stacks ceil(m/d) blocks, truncating the last), each row scaled by
    ``jl_row_scale(d)``; orthogonal rows lower the variance (QJL paper, Section 4). ``version``:
    see ``JL_VERSIONS``.
    """
    jl_check(m, d, kind, version)
    rng = generator(seed, purpose, m, d)
    if kind == "gaussian":
        return rng.standard_normal((m, d))
    if m < d and version >= 2:
        return haar_frame(d, m, rng).T * jl_row_scale(d)
    blocks = []
    rows = 0
    while rows < m:
        q = haar_matrix(d, rng)
        blocks.append(q[: min(d, m - rows)])
        rows += blocks[-1].shape[0]
    return np.concatenate(blocks, axis=0) * jl_row_scale(d)


def _sha(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Rotation:
    """An orthogonal map of R^d fixed by ``(kind, d, seed)``."""

    kind: str
    d: int

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # (n, d) float32 -> (n, d) float32
        raise NotImplementedError

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def matrix(self) -> torch.Tensor:
        """The (d, d) float32 matrix M with apply(x) == x @ M.T (up to rounding)."""
        return self.apply(torch.eye(self.d)).T.contiguous()


class HaarRotation(Rotation):
    """Dense Haar rotation (TurboQuant paper, Algorithm 1): y = Pi x as one float32 GEMM."""

    kind = "haar"

    def __init__(self, d: int, seed: int):
        haar_check(d)
        self.d = d
        self.seed = seed
        self._m64 = haar_matrix(d, generator(seed, "rotation.haar", d))
        self._m = torch.from_numpy(self._m64.astype(np.float32))
        self._on: dict[torch.device, torch.Tensor] = {}

    def _mat(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self._m
        if device not in self._on:
            self._on[device] = self._m.to(device)
        return self._on[device]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self._mat(x.device).T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self._mat(y.device)

    def fingerprint(self) -> str:
        return _sha(self._m.numpy())

    def matrix(self) -> torch.Tensor:
        return self._m


class HadamardRotation(Rotation):
    """Multi-round randomized Hadamard rotation for any d, O(d log d) per vector.

    p = the largest power of two <= d. Round r: permute by a random permutation, flip random
    signs, then apply H_p / sqrt(p) to the first p coordinates and, when p < d, to the last p
    (the two blocks overlap and cover all of R^d). The composition is exactly orthogonal and
    keeps exactly d coordinates (no padding to 2^k, so codes cost exactly d*b bits). One round of
    D.H maps e_1 to a vector of equal magnitudes; the default 3 rounds make one-hot, sparse and
    constant inputs behave like random ones (tests/test_random.py measures it).
    """

    kind = "hadamard"

    def __init__(self, d: int, seed: int, rounds: int = 3):
        self.d = d
        self.seed = seed
        self.rounds = rounds
        rng = generator(seed, "rotation.hadamard", d, rounds)
        self.p = 1 << (d.bit_length() - 1)
        self.perms = torch.from_numpy(np.stack([rng.permutation(d) for _ in range(rounds)])
                                      .astype(np.int64))
        self.signs = torch.from_numpy(
            (rng.integers(0, 2, size=(rounds, d)) * 2 - 1).astype(np.float32))
        self._on: dict[torch.device, ops.HadamardRotate] = {}

    def op(self, device: torch.device) -> ops.HadamardRotate:
        """The prepared rotation op on ``device`` (made once per device)."""
        op = self._on.get(device)
        if op is None:
            op = self._on[device] = ops.HadamardRotate(self.perms.to(device),
                                                       self.signs.to(device), self.p)
        return op

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.device)(x)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return self.op(y.device)(y, inverse=True)

    def fingerprint(self) -> str:
        return _sha(self.perms.numpy(), self.signs.numpy(), np.array([self.p], np.int64))


@functools.lru_cache(maxsize=64)
def make_rotation(kind: str, d: int, seed: int, rounds: int = 3) -> Rotation:
    """Cached rotation for ``(kind, d, seed, rounds)``; ``rounds`` only applies to hadamard."""
    if kind == "haar":
        return HaarRotation(d, seed)
    if kind == "hadamard":
        return HadamardRotation(d, seed, rounds)
    raise ValueError(f"rotation must be one of {list(ROTATIONS)}, got {kind!r}")
