"""The graph index (tqvec.index.graph): against brute force and an exhaustive traversal, every
metric, filters, removal, files, and hostile parameters."""

import numpy as np
import pytest
import torch

import tqvec
from tqvec import ops
from tqvec.codecs import QJL, TurboQuant
from tqvec.errors import FormatError
from tqvec.index import GraphIndex, index_factory, read_index, write_index
from tqvec.index.state import index_from_state

pytestmark = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="tqvec._C not built")


def low_rank(n, d, seed=0, r=8):
    """Rows near an r-dimensional subspace (a low intrinsic dimension, as real embeddings and
    images have: a graph's neighbours then lead somewhere)."""
    rng = np.random.default_rng(seed)
    basis = np.random.default_rng(99).standard_normal((r, d)).astype(np.float32)
    z = rng.standard_normal((n, r)).astype(np.float32)
    return (z @ basis + 0.1 * rng.standard_normal((n, d))).astype(np.float32)


def brute(x, q, k, metric, ids=None):
    """Exact top-k (distances or similarities, ids) by numpy in float64."""
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    if metric == "cosine":
        x64 = x64 / np.linalg.norm(x64, axis=1, keepdims=True)
        q64 = q64 / np.linalg.norm(q64, axis=1, keepdims=True)
    s = q64 @ x64.T
    if metric == "l2":
        s = 2 * s - (x64 * x64).sum(1)[None, :] - (q64 * q64).sum(1)[:, None]
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    vals = np.take_along_axis(s, order, 1)
    ids = np.arange(len(x)) if ids is None else np.asarray(ids)
    return (-vals if metric == "l2" else vals), ids[order]


def recall(I, I0):
    return np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(I, I0, strict=True)])


@pytest.fixture(scope="module")
def data():
    x = low_rank(3000, 64)
    q = low_rank(40, 64, seed=1)
    return x, q


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_recall_against_brute_force(data, metric, bits):
    x, q = data
    idx = index_factory(64, f"HNSW16,TQ{bits},Refine(Flat)", metric)
    idx.add(x)
    idx.efSearch = 64
    D, I = idx.search(q, 10)
    D0, I0 = brute(x, q, 10, metric)
    assert recall(I, I0) >= 0.97
    # the re-rank is exact: each returned row's value is its true distance / similarity
    for i in range(len(q)):
        d_true, _ = brute(x[I[i]], q[i:i + 1], 10, metric)
        np.testing.assert_allclose(np.sort(D[i]), np.sort(d_true[0]), rtol=2e-4, atol=2e-3)
    best_first = np.diff(D, axis=1)
    assert (best_first >= -1e-4).all() if metric == "l2" else (best_first <= 1e-4).all()


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_exhaustive_traversal_is_brute_force(data, metric):
    """efSearch = n: best-first search expands every reachable row and scores each exactly,
    so the result is the exact top-k (an oracle independent of the graph and the codes)."""
    x, q = data
    x, q = x[:600], q[:10]
    idx = index_factory(64, "HNSW8,TQ1,Refine(Flat)", metric)
    idx.add(x)
    idx.efSearch = len(x)
    D, I = idx.search(q, 7)
    D0, I0 = brute(x, q, 7, metric)
    np.testing.assert_array_equal(I, I0)
    np.testing.assert_allclose(D, D0, rtol=1e-4, atol=1e-3)


def test_without_refinement_matches_the_flat_index_estimates(data):
    """No refinement: the results are the codes' estimates; an exhaustive traversal returns
    the flat index's top-k rows (same codec, same estimator)."""
    x, q = data
    x, q = x[:500], q[:8]
    g = GraphIndex(TurboQuant(64, 4), 8, "ip")
    g.add(x)
    g.efSearch = len(x)
    flat = tqvec.FlatIndex(TurboQuant(64, 4), "ip")
    flat.add(x)
    Dg, Ig = g.search(q, 5)
    Df, If = flat.search(q, 5)
    assert recall(Ig, If) >= 0.97
    np.testing.assert_allclose(Dg[Ig == If], Df[Ig == If], rtol=0.02, atol=0.05)


def test_one_call_and_composed_paths_agree(data):
    """float32 numpy queries take the one compiled call; float64 ones the composition (query
    preparation, graph search, re-rank): the same results."""
    x, q = data
    idx = index_factory(64, "HNSW16,TQ2,Refine(Flat)", "l2")
    idx.add(x)
    D1, I1 = idx.search(q, 10)
    D2, I2 = idx.search(q.astype(np.float64), 10)
    np.testing.assert_array_equal(I1, I2)
    np.testing.assert_allclose(D1, D2, rtol=1e-6, atol=1e-5)


def test_threads_give_the_same_results(data, monkeypatch):
    x, q = data
    idx = index_factory(64, "HNSW16,TQ2,Refine(Flat)")
    idx.add(x)
    monkeypatch.setattr(ops, "threads", lambda: 1)
    one = idx.search(q, 10)
    monkeypatch.setattr(ops, "threads", lambda: 2)
    two = idx.search(q, 10)
    np.testing.assert_array_equal(one[1], two[1])
    np.testing.assert_array_equal(one[0], two[0])


def test_filter_and_ids(data):
    x, q = data
    x, q = x[:800], q[:6]
    ids = np.arange(len(x)) * 7 + 100
    idx = index_factory(64, "HNSW8,TQ2,Refine(Flat)")
    idx.add_with_ids(x, ids)
    idx.efSearch = len(x)
    allowed = ids[::3]
    D, I = idx.search(q, 5, allowed_ids=allowed)
    assert np.isin(I, allowed).all()
    D0, I0 = brute(x[::3], q, 5, "l2", ids=allowed)
    np.testing.assert_array_equal(I, I0)


def test_remove_rebuilds_the_graph(data):
    x, q = data
    x, q = x[:700], q[:6]
    idx = index_factory(64, "HNSW8,TQ2,Refine(Flat)")
    idx.add(x)
    idx.search(q, 5)
    gone = np.arange(0, len(x), 2)
    assert idx.remove_ids(gone) == len(gone)
    assert idx.ntotal == len(x) - len(gone)
    idx.efSearch = len(x)
    D, I = idx.search(q, 5)
    assert not np.isin(I, gone).any()
    keep = np.arange(1, len(x), 2)
    _, I0 = brute(x[keep], q, 5, "l2", ids=keep)
    np.testing.assert_array_equal(I, I0)
    idx.add(x[:4])  # new rows after a removal join the rebuilt graph
    assert idx.search(x[:1], 1)[0][0, 0] == pytest.approx(0.0, abs=1e-3)


def test_adds_after_a_search_extend_the_laid_out_graph(data):
    """A search lays the graph out and drops faiss's index (its copy of the vectors); the next
    add restores it from the adjacency and extends the graph: recall holds."""
    x, q = data
    idx = index_factory(64, "HNSW16,TQ2,Refine(Flat)")
    idx.add(x[:1500])
    idx.search(q, 10)
    for lo in (1500, 2200):
        idx.add(x[lo:lo + 700 if lo == 1500 else len(x)])
        idx.efSearch = 64
        D, I = idx.search(q, 10)
    _, I0 = brute(x, q, 10, "l2")
    assert idx.ntotal == len(x) and recall(I, I0) >= 0.97
    assert (idx.search(x[2990:2991], 1)[1] == 2990).all()


def test_small_and_empty(data):
    x, q = data
    idx = index_factory(64, "HNSW4,TQ1,Refine(Flat)")
    D, I = idx.search(q[:2], 3)
    assert (I == -1).all()
    idx.add(x[:1])
    D, I = idx.search(q[:2], 3)
    assert I[:, 0].tolist() == [0, 0] and (I[:, 1:] == -1).all()
    idx.add(x[1:3])
    D, I = idx.search(x[:3], 3)
    assert sorted(I[0].tolist()) == [0, 1, 2]
    assert I[:, 0].tolist() == [0, 1, 2]
    idx.reset()
    assert idx.ntotal == 0 and (idx.search(q[:1], 2)[1] == -1).all()


def test_files_round_trip(tmp_path, data):
    x, q = data
    idx = index_factory(64, "HNSW16,TQ2,Refine(Flat)", "cosine")
    idx.add(x)
    idx.efSearch = 48
    D, I = idx.search(q, 10)
    path = tmp_path / "g.tqi"
    write_index(idx, str(path))
    for mmap in (False, True):
        back = read_index(str(path), mmap=mmap)
        assert isinstance(back, GraphIndex) and back.efSearch == 48 and back.M == 16
        D2, I2 = back.search(q, 10)
        np.testing.assert_array_equal(I, I2)
        np.testing.assert_array_equal(D, D2)
    back.add(x[:5])  # extends a graph read from a file (faiss's graph rebuilt over every row)
    assert back.ntotal == len(x) + 5
    assert back.search(x[3:4], 2)[0][0, 0] == pytest.approx(1.0, abs=1e-4)


def test_damaged_graph_state_is_a_format_error(data):
    x, _ = data
    idx = index_factory(64, "HNSW8,TQ1")
    idx.add(x[:200])
    meta, arrays = idx.state()
    bad = dict(arrays)
    bad["graph.base"] = arrays["graph.base"].copy()
    bad["graph.base"][3, 0] = 10_000
    with pytest.raises(FormatError, match="graph"):
        index_from_state(meta, bad)
    bad = dict(arrays)
    bad["graph.upper"] = arrays["graph.upper"][:-1]
    with pytest.raises(FormatError, match="graph"):
        index_from_state(meta, bad)
    bad = dict(arrays)
    del bad["graph.levels"]
    with pytest.raises(FormatError, match="graph.levels"):
        index_from_state(meta, bad)
    with pytest.raises(FormatError, match="graph"):
        index_from_state(dict(meta, entry=10_000), arrays)


@pytest.mark.parametrize("bad", [0, -1, 1 << 20, 2.5, "64", None])
def test_hostile_ef_search(bad):
    idx = index_factory(16, "HNSW8,TQ1")
    with pytest.raises((ValueError, TypeError), match="efSearch"):
        idx.efSearch = bad


@pytest.mark.parametrize("spec,match", [
    ("HNSW16,TQ8", "TurboQuant-mse at"),
    ("HNSW1,TQ2", "M must"),
    ("HNSW16,Flat", "HNSW\\{M\\},TQ\\{b\\}"),
    ("HNSW16", "HNSW\\{M\\},TQ\\{b\\}"),
    ("HNSW16,TQ2,Prefilter(4)", "graph index"),
    ("HNSW16,TQprod3", "graph index"),
])
def test_hostile_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        index_factory(16, spec)


def test_hostile_constructor_and_queries(data):
    x, q = data
    with pytest.raises(ValueError, match="TurboQuant-mse"):
        GraphIndex(QJL(16, 64), 8)
    with pytest.raises(ValueError, match="TurboQuant-mse"):
        GraphIndex(TurboQuant(16, 2, "prod"), 8)
    with pytest.raises(ValueError, match="M must"):
        GraphIndex(TurboQuant(16, 2), 1000)
    with pytest.raises(ValueError, match="prefilter"):
        GraphIndex(TurboQuant(16, 2)).prefilter = 3
    idx = index_factory(64, "HNSW8,TQ1,Refine(Flat)")
    idx.add(x[:100])
    bad = q[:2].copy()
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        idx.search(bad, 3)
    with pytest.raises(ValueError, match="dimension|shape|columns"):
        idx.search(q[:2, :10], 3)
    with pytest.raises(ValueError, match="k"):
        idx.search(q[:2], 0)


def test_searcher_checks_its_layers():
    """The compiled searcher refuses a graph that would make it read out of bounds."""
    if "cpu" not in ops.available_backends():
        pytest.skip("tqvec._C not built")
    nb = np.full((4, 32), -1, np.int32)
    nb[:, 0] = [1, 2, 3, 0]
    codes = np.zeros((4, 1, 2, 32), np.uint8)
    f = np.zeros((4, 32), np.float32)
    ok = dict(neighbours=[nb], codes=[codes], mult=[f], add=[f], slots=[np.empty(0, np.int32)])
    entry = dict(entry_codes=codes[:1], entry_mult=f[:1], entry_add=f[:1])

    def searcher(layers=ok, entry_layer=entry, entry_row=0):
        args = ops.GraphSearchArgs(layers, entry_layer, 4, 16, 1,
                                   torch.tensor([-1.0, 1.0]), entry_row)
        return ops.prepare("graph_search", args, torch.device("cpu"), "cpu")

    assert not searcher().whole
    with pytest.raises(ValueError, match="entry_codes must have shape"):
        searcher(entry_layer=dict(entry, entry_codes=codes[:2]))
    bad = nb.copy()
    bad[2, 1] = 4
    with pytest.raises(ValueError, match="neighbours must be -1 or rows"):
        searcher(dict(ok, neighbours=[bad]))
    with pytest.raises(ValueError, match="entry"):
        searcher(entry_row=9)
    with pytest.raises(ValueError, match="codes must have shape"):
        searcher(dict(ok, codes=[codes[:, :, :1]]))
    up = np.full((1, 32), -1, np.int32)
    up[0, 0] = 3  # row 3 is not in the upper layer (slot -1)
    slot = np.array([0, -1, -1, -1], np.int32)
    with pytest.raises(ValueError, match="nodes of that layer"):
        searcher(dict(ok, neighbours=[nb, up], codes=[codes, codes[:1]], mult=[f, f[:1]],
                      add=[f, f[:1]], slots=[np.empty(0, np.int32), slot]))


@pytest.mark.parametrize("refine", ["", ",Refine(Flat)"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_every_row_of_a_tiny_graph_is_found(n, refine):
    """The search starts from the entry's own estimate: a graph of one row found nothing
    without a refinement (a node was scored only from its neighbours' lists)."""
    x = np.random.default_rng(0).standard_normal((n, 16)).astype(np.float32)
    idx = index_factory(16, "HNSW8,TQ2" + refine)
    idx.add(x)
    D, I = idx.search(x, n)
    assert sorted(I[0].tolist()) == list(range(n))
    assert (I >= 0).all()


def test_memory_counts_the_layout(data):
    x, _ = data
    idx = index_factory(64, "HNSW16,TQ1,Refine(Flat)")
    idx.add(x)
    before = idx.memory_bytes()
    idx.search(x[:1], 1)
    after = idx.memory_bytes()
    n = len(x)
    # the layout, 2 M links per row of 8 bytes of codes (64 1-bit coordinates) + row, mult and
    # add, and the refinement's vectors are held; faiss's copy of the vectors is not any more
    assert after >= n * (32 * (8 + 12) + 64 * 4)
    assert after < before + n * 32 * (8 + 12 + 4) - n * 64 * 4 // 2


def test_layout_in_chunks_is_the_same(monkeypatch):
    """A layer laid out a few nodes at a time (chunks ending mid-layer) holds the same records
    as one laid out at once, and padding gets multiplier 0 and offset -inf."""
    import tqvec.index.graph as graph_module
    rng = np.random.default_rng(5)
    n, d, b = 50, 40, 2
    nb = rng.integers(-1, n, size=(n, 64)).astype(np.int32)
    packed = rng.integers(0, 256, size=(n, ops.row_bytes(d, b)), dtype=np.uint8)
    mult = rng.standard_normal(n).astype(np.float32)
    add = rng.standard_normal(n).astype(np.float32)
    whole = graph_module._lay_out(nb, packed, mult, add, d, b)
    monkeypatch.setattr(graph_module, "_LAYOUT_CHUNK_BYTES", 7 * 64 * packed.shape[1])
    chunked = graph_module._lay_out(nb, packed, mult, add, d, b)
    for a, c in zip(whole, chunked, strict=True):
        np.testing.assert_array_equal(a, c)
    codes, em, ea = whole
    live = nb >= 0
    np.testing.assert_array_equal(em[~live], 0.0)
    assert np.isneginf(ea[~live]).all()
    np.testing.assert_array_equal(em[live], mult[nb[live]])
    np.testing.assert_array_equal(ea[live], add[nb[live]])
    # node 3's second block holds its neighbours 32..63 in the fast-scan layout (padding: zeros)
    rows = np.where(live[3, 32:], nb[3, 32:], 0)
    gathered = np.where(live[3, 32:, None], packed[rows], 0).astype(np.uint8)
    expect = ops.block_codes(torch.from_numpy(gathered), d, b).numpy()[0]
    np.testing.assert_array_equal(codes[3, 1], expect)


def test_exact_vectors_read_into_memory_go_onto_huge_pages(tmp_path, monkeypatch):
    """A file read into memory puts Refine(Flat)'s vectors where added rows go (huge pages
    where the system gives them); a memory-mapped file keeps its mapping."""
    from tqvec.ops import pages
    monkeypatch.setattr(pages, "MIN_BYTES", 1 << 12)
    x = low_rank(200, 64)
    idx = index_factory(64, "HNSW16,TQ2,Refine(Flat)")
    idx.add(x)
    path = str(tmp_path / "g.tqv")
    write_index(idx, path)
    read = read_index(path)
    mapped = read_index(path, mmap=True)
    aligned = read._rows.ref.data_ptr() % pages.HUGE_PAGE == 0
    assert aligned == pages._POSSIBLE
    np.testing.assert_array_equal(read._rows.ref.numpy(), x)
    for other in (read, mapped):
        np.testing.assert_array_equal(other.search(x[:5], 5)[1], idx.search(x[:5], 5)[1])
