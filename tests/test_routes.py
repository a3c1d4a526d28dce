"""Every search route of every index gives the same results.

An index's search is one composition (prepare the queries -> scan -> re-rank -> ids) whose scan
is chosen in one place (``_route``), and a fused compiled call may run the whole composition for
float32 numpy queries. This runs each factory string x metric x input type through every route
that applies to it - the fused call, the fast-scan kernels, per-query lookup tables, decoded
blocks (flat); the fused call, the fast scan of the blocked lists, the codec list by list (IVF)
- and compares: the fused call with the composition it implements bit for bit, the other routes
(other float operations: table sums, a GEMM) to float rounding, with ids equal wherever the
scores are not tied within that rounding. Two kinds of index choose candidates differently by
design where the fast scan runs: a ``Prefilter`` takes its candidates from a coarse first pass
(the other routes scan exactly: they match the index without the prefilter), and a refinement's
fast scan ranks its k_factor k candidates by the kernel's tables (the other routes by exact
scores: the re-ranked results share nearly all ids, with equal distances).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tqvec
from tqvec.index import FlatIndex, IVFIndex, PCAIndex

FLAT = ["TQ1", "TQ2", "TQ4", "TQ3f", "TQ2u", "TQ2,Prefilter(5)", "Center,TQ2f,Prefilter(5)",
        "TQ2,Prefilter", "Center,TQ4u,Prefilter",
        "TQ1,Refine(TQ8g)", "TQ2,Refine(Flat)", "Center,TQ2,Refine(TQ4)", "TQprod3", "QJL64",
        "Polar"]
IVF = ["IVF8,TQ2", "IVF8,TQ1,Refine(TQ8g)", "IVF8,TQ4,Refine(Flat)", "IVF8,Polar"]
PCA = ["PCA,TQ2", "PCA,TQ2,Prefilter(5)"]
INPUTS = {"numpy32": lambda q: q, "torch32": torch.from_numpy,
          "numpy16": lambda q: q.astype(np.float16).astype(np.float32)[None][0].copy()}


def _data(seed=3, n=3000, d=48, nq=9):
    rng = np.random.default_rng(seed)
    low = rng.standard_normal((n + nq, 8)).astype(np.float32)
    x = low @ rng.standard_normal((8, d)).astype(np.float32)
    x += 0.3 * rng.standard_normal((n + nq, d)).astype(np.float32) + 1.0
    return x[:n], x[n:]


def _same(a, b, exact: bool) -> None:
    (Da, Ia), (Db, Ib) = a, b
    assert Da.dtype == Db.dtype == np.float32 and Ia.dtype == Ib.dtype == np.int64
    if exact:
        np.testing.assert_array_equal(Ia, Ib)
        np.testing.assert_array_equal(Da, Db)
        return
    tol = 1e-4 * max(1.0, float(np.abs(Da[np.isfinite(Da)]).max(initial=0)))
    np.testing.assert_allclose(Da, Db, rtol=1e-4, atol=tol)
    for i in range(len(Ia)):  # ids differ only where scores tie within the rounding
        for j in np.nonzero(Ia[i] != Ib[i])[0]:
            near = np.abs(Da[i] - Da[i, j]) <= 2 * tol
            assert Ib[i, j] in set(Ia[i][near]) or np.isclose(Db[i, j], Da[i, j], atol=2 * tol)


def _close_candidates(a, b) -> None:
    """Re-ranked results of two candidate sets: nearly the same ids, equal distances where
    the ids agree."""
    (Da, Ia), (Db, Ib) = a, b
    for i in range(len(Ia)):
        common = np.intersect1d(Ia[i], Ib[i])
        assert len(common) >= 0.8 * len(Ia[i])
        da = {int(j): v for j, v in zip(Ia[i], Da[i], strict=True)}
        db = {int(j): v for j, v in zip(Ib[i], Db[i], strict=True)}
        assert all(np.isclose(da[int(j)], db[int(j)], rtol=1e-4, atol=1e-3) for j in common)


def _routes(index) -> list[str]:
    """The routes that apply to this index after a search built its state."""
    inner = index.index if isinstance(index, PCAIndex) else index
    snap = inner.snapshot()
    if isinstance(inner, IVFIndex):
        return (["fast"] if snap.scan.scanner is not None else []) + ["lists"]
    out = []
    if snap.scan is not None and snap.scan.fast:
        out.append("fast")
    if snap.scan is not None and inner._lut_ok():
        out.append("lut")
    return out + ["gemm"]


def _forced(index, route, monkeypatch):
    """The index with its scan route forced (and the fused call off)."""
    inner = index.index if isinstance(index, PCAIndex) else index
    monkeypatch.setattr(inner, "_fused_search", lambda *a, **k: None)
    if isinstance(index, PCAIndex):
        monkeypatch.setattr(index, "_search_fused", lambda *a, **k: None)
    monkeypatch.setattr(inner, "_route", lambda *a, **k: route)
    return index


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("spec", FLAT + IVF + PCA)
def test_every_route_gives_the_same_results(spec, metric, monkeypatch):
    if "cpu" not in tqvec.available_backends():
        pytest.skip("the compiled kernels give most routes")
    xb, xq = _data()
    index = tqvec.index_factory(xb.shape[1], spec, metric)
    index.train(xb)
    index.add_with_ids(xb, np.arange(len(xb)) * 2 + 1)
    index.remove_ids(np.arange(0, len(xb), 7) * 2 + 1)  # the state follows removals
    if isinstance(index, IVFIndex):
        index.nprobe = 3
    k = 10
    default = {name: index.search(make(xq), k) for name, make in INPUTS.items()}
    # numpy and torch queries: the same composition, or the fused call, bit for bit (a PCA
    # index's folded query map: to rounding)
    _same(default["numpy32"], default["torch32"], exact=not spec.startswith("PCA"))
    _same(default["numpy16"], index.search(torch.from_numpy(INPUTS["numpy16"](xq)), k),
          exact=not spec.startswith("PCA"))
    routes = _routes(index)
    assert routes[-1] in ("gemm", "lists")
    exact_scan = index
    if "Prefilter" in spec:  # the other routes scan every row's full code
        exact_scan = tqvec.index_factory(xb.shape[1], re.sub(r",Prefilter(\(\d+\))?", "", spec),
                                         metric)
        exact_scan.train(xb)
        exact_scan.add_with_ids(xb, np.arange(len(xb)) * 2 + 1)
        exact_scan.remove_ids(np.arange(0, len(xb), 7) * 2 + 1)
    filt = np.arange(1, 2 * len(xb), 6)
    for allowed in (None, filt):
        want = {name: index.search(make(xq), k, allowed_ids=allowed)
                for name, make in INPUTS.items()}
        want_exact = {name: exact_scan.search(make(xq), k, allowed_ids=allowed)
                      for name, make in INPUTS.items()}
        for route in routes:
            with monkeypatch.context() as m:
                forced = _forced(index, route, m)
                for name, make in INPUTS.items():
                    got = forced.search(make(xq), k, allowed_ids=allowed)
                    if allowed is not None:
                        assert np.isin(got[1][got[1] >= 0], filt).all()
                    if route == "fast" or (routes[0] != "fast" and route == routes[0]):
                        # the route the index takes by default (or its fused call): exact;
                        # a PCA index folds its basis into the query map for numpy queries
                        # (another rounding of the same products)
                        _same(want[name], got, exact=not (spec.startswith("PCA")
                                                          and name != "torch32"))
                    elif "Refine" in spec and routes[0] == "fast":
                        _close_candidates(want[name], got)
                    else:
                        _same(want_exact[name], got, exact=False)


def test_the_fused_call_runs_where_it_applies():
    """TurboQuant-mse codes with a Hadamard rotation (flat and IVF) have the one compiled call;
    other codecs the composition only."""
    if "cpu" not in tqvec.available_backends():
        pytest.skip("compiled module missing")
    xb, xq = _data()
    for spec, fused in (("TQ2", True), ("Center,TQ2f,Prefilter(5)", True),
                        ("TQ2,Refine(Flat)", True), ("TQprod3", False), ("QJL64", False),
                        ("IVF8,TQ2", True), ("IVF8,Polar", False)):
        index = tqvec.index_factory(xb.shape[1], spec, "l2")
        index.train(xb)
        index.add(xb)
        index.search(xq, 5)
        scan = index.snapshot().scan
        assert (scan is not None and scan.fused is not None) == fused, spec
        assert isinstance(index, (FlatIndex, IVFIndex))


@pytest.mark.skipif("cpu" not in tqvec.ops.available_backends(), reason="tqvec._C not built")
@pytest.mark.parametrize("spec", ["TQ2", "TQ4u"])
def test_a_small_index_keeps_the_fast_scan(spec, monkeypatch):
    """Few rows per result (64 rows, k = 10): the exact scan stays on the fast-scan kernels,
    whose layout holds the codes - the per-query tables would gather them back on every call."""
    xb, xq = _data(n=64, nq=3)
    index = tqvec.index_factory(xb.shape[1], spec)
    index.add(xb)
    expected = index.search(xq, 10)

    def gathered(*a, **k):
        raise AssertionError("the codes were scanned by per-query tables")

    monkeypatch.setattr(tqvec.ops, "lut_scan", gathered)
    for q in (xq, torch.from_numpy(xq), xq[:1]):
        _, I = index.search(q, 10)
        assert np.array_equal(I, expected[1][:len(q)])
