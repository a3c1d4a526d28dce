"""Files written by earlier tqvec versions stay readable and mean the same.

Each golden file was written once by ``make_golden`` and is committed; a reader change that
refuses one, or a codec change that decodes or ranks one differently, fails here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import tqvec
from tqvec.io import read_container, write_container

GOLDEN = Path(__file__).parent / "golden"

#: codes files: (file stem, codec factory) - a JL sketch with fewer rows than the dimension
#: (m < d) was drawn as the first m rows of a d x d Haar matrix before the thin draw.
CODES = {
    "turboquant_prod3_d24_v1": lambda: tqvec.TurboQuant(24, 3, "prod", seed=5),
    "qjl_m16_d32_outlier_v1": lambda: tqvec.QJL(32, 16, seed=3, outliers=[1, 7]),
    "turboquant_prod3_m16_d32_v1": lambda: tqvec.TurboQuant(32, 3, "prod", seed=4,
                                                            sketch_dim=16),
}

#: index files: (file stem, factory spec, metric)
INDEXES = {
    "flat_tq4_l2_v1": ("TQ4", "l2"),
    "flat_center_tq2f_prefilter_ip_v1": ("Center,TQ2f,Prefilter(10)", "ip"),
    "flat_tq1_refine_tq8g_cosine_v1": ("TQ1,Refine(TQ8g)", "cosine"),
    "flat_qjl64_ip_v1": ("QJL64", "ip"),
    "flat_polar_l2_v1": ("Polar", "l2"),
    "flat_tqprod3_refine_flat_ip_v1": ("TQprod3,Refine(Flat)", "ip"),
    "ivf4_tq3_l2_v1": ("IVF4,TQ3", "l2"),
    "ivf4_tq2_refine_flat_ip_v1": ("IVF4,TQ2,Refine(Flat)", "ip"),
    "pca_tq2_l2_v1": ("PCA,TQ2", "l2"),
}
_D, _N, _K = 32, 300, 5


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2026)
    low = rng.standard_normal((_N + 4, 6)).astype(np.float32)
    x = low @ rng.standard_normal((6, _D)).astype(np.float32) + 0.1 * rng.standard_normal(
        (_N + 4, _D)).astype(np.float32)
    return x[:_N], x[_N:]


@pytest.mark.parametrize("stem", sorted(CODES))
def test_golden_codes_still_decode(stem):
    """The bytes, the rotation and the codebooks stay readable and decode to the same values."""
    codes = tqvec.load_codes(GOLDEN / f"{stem}.tqc")
    meta, arrays, _ = read_container(GOLDEN / f"{stem}.expected", "expected")
    c = tqvec.codec_from_params(codes.params)
    np.testing.assert_allclose(c.decode(codes, like=np.empty(0)), arrays["decoded"], rtol=1e-5,
                               atol=1e-6)
    assert meta["params"] == dict(codes.params)


@pytest.mark.parametrize("stem", sorted(INDEXES))
@pytest.mark.parametrize("mmap", [False, True])
def test_golden_indexes_still_search(stem, mmap):
    """An index file of every kind loads and returns the (D, I) it returned when written."""
    index = tqvec.read_index(GOLDEN / f"{stem}.tqv", mmap=mmap)
    meta, arrays, _ = read_container(GOLDEN / f"{stem}.expected", "expected")
    assert meta["spec"] == list(INDEXES[stem])
    assert index.ntotal == _N
    _, q = _data()
    D, I = index.search(q, _K)
    np.testing.assert_array_equal(I, arrays["I"])
    np.testing.assert_allclose(D, arrays["D"], rtol=1e-5, atol=1e-5)


def make_golden() -> None:  # pragma: no cover
    """Run once by hand for new entries: python -c "from tests.test_golden import make_golden;
    make_golden()". Existing files are never rewritten."""
    os.makedirs(GOLDEN, exist_ok=True)
    rng = np.random.default_rng(2026)
    for stem, make in CODES.items():
        if (GOLDEN / f"{stem}.tqc").exists():
            continue
        c = make()
        x = rng.standard_normal((6, c.dim)).astype(np.float32)
        codes = c.encode(x)
        tqvec.save_codes(GOLDEN / f"{stem}.tqc", codes)
        write_container(GOLDEN / f"{stem}.expected", "expected", {"params": c.params},
                        {"decoded": c.decode(codes, like=x)})
    x, q = _data()
    for stem, (spec, metric) in INDEXES.items():
        if (GOLDEN / f"{stem}.tqv").exists():
            continue
        index = tqvec.index_factory(_D, spec, metric=metric, seed=7)
        index.train(x)
        index.add(x)
        tqvec.write_index(index, GOLDEN / f"{stem}.tqv")
        D, I = tqvec.read_index(GOLDEN / f"{stem}.tqv").search(q, _K)
        write_container(GOLDEN / f"{stem}.expected", "expected", {"spec": [spec, metric]},
                        {"D": D, "I": I})
