"""The compiled kernels' worker pool (csrc/cpu/parallel.h): results do not depend on the thread
count, on searches running at once from several Python threads (the GIL is released, so a second
caller finds the pool busy and gets threads of its own), nor on a fork() (the child starts a pool
of its own: the parent's threads do not exist there)."""

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch

import tqvec
from tqvec import ops

pytestmark = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="compiled kernels not built")

SPECS = [("TQ4", {}), ("TQ2,Prefilter(10)", {}), ("IVF16,TQ2", {"nprobe": 8}),
         ("IVF16,TQ1,Refine(TQ8g)", {"nprobe": 8, "k_factor": 3})]


def _data(n=6000, d=64, nq=40, seed=0):
    rng = np.random.default_rng(seed)
    c = 3 * rng.standard_normal((16, d))
    xb = (c[rng.integers(0, 16, n)] + rng.standard_normal((n, d))).astype(np.float32)
    xq = (c[rng.integers(0, 16, nq)] + rng.standard_normal((nq, d))).astype(np.float32)
    return xb, xq


def _index(spec, params, xb):
    index = tqvec.index_factory(xb.shape[1], spec, metric="l2", seed=3)
    if not index.is_trained:
        index.train(xb)
    index.add(xb)
    for name, value in params.items():
        setattr(index, name, value)
    return index


def _one_by_one(index, xq, k=10):
    out = [index.search(q[None], k) for q in xq]
    return np.concatenate([d for d, _ in out]), np.concatenate([i for _, i in out])


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("spec,params", SPECS)
def test_results_do_not_depend_on_the_thread_count(spec, params, restore_threads):
    xb, xq = _data()
    index = _index(spec, params, xb)
    torch.set_num_threads(1)
    d1, i1 = _one_by_one(index, xq)
    b1 = index.search(xq, 10)
    # more threads than this machine has cores, and back and forth between counts: the pool
    # grows and runs with fewer workers than it holds
    for t in (2, 4, 3, 2):
        torch.set_num_threads(t)
        dt, it = _one_by_one(index, xq)
        np.testing.assert_array_equal(it, i1)
        np.testing.assert_allclose(dt, d1, rtol=1e-5, atol=1e-5)
        bd, bi = index.search(xq, 10)
        np.testing.assert_array_equal(bi, b1[1])


def test_concurrent_searches_from_python_threads(restore_threads):
    torch.set_num_threads(2)
    xb, xq = _data()
    indexes = [_index(spec, params, xb) for spec, params in SPECS]
    expected = [_one_by_one(index, xq)[1] for index in indexes]
    got: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def work(w):
        try:
            got[w] = [_one_by_one(index, xq)[1] for index in indexes]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors and not any(th.is_alive() for th in threads)
    for w in range(4):
        for e, g in zip(expected, got[w], strict=True):
            np.testing.assert_array_equal(g, e)


def _child_pack(conn, idx):
    torch.set_num_threads(2)
    conn.send(ops.pack_bits(torch.from_numpy(idx), 2).numpy())
    conn.close()


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="no fork on this platform")
def test_a_forked_child_runs_kernels_with_its_own_pool(restore_threads):
    # pack_bits splits rows between the pool's workers and runs no torch parallel region (torch's
    # OpenMP team does not survive a fork once used, whatever we do)
    torch.set_num_threads(2)
    idx = np.random.default_rng(0).integers(0, 4, (20_000, 64), dtype=np.uint8)
    expected = ops.pack_bits(torch.from_numpy(idx), 2).numpy()  # the parent's pool is started
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child_pack, args=(child, idx))
    p.start()
    assert parent.poll(60), "the forked child did not answer (a pool waiting on threads the " \
                            "child does not have)"
    np.testing.assert_array_equal(parent.recv(), expected)
    p.join(30)
    assert p.exitcode == 0


def test_an_exception_on_a_pool_worker_reaches_the_caller(tmp_path):
    """tests/native/pool_errors.cpp: a task that throws on a worker other than the caller's
    thread raises in the caller (it once ended the process in std::terminate), and the pool
    keeps working after it."""
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = Path(__file__).resolve().parent / "native" / "pool_errors.cpp"
    exe = tmp_path / "pool_errors"
    subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "pool worker: caught worker 2", "pool caller: caught worker 0",
        "pool again: caught worker 3", "fresh threads: caught worker 1",
        "no error: no exception"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_while_another_thread_holds_an_index_lock():
    """fork() waits for a change another thread is making under an index's lock (here a first
    search building its layout), so the child's own first search does not wait forever on a
    lock whose holder does not exist there."""
    xb, xq = _data(n=3000)
    index = _index("TQ4", {}, xb)
    want = index.search(xq, 10)
    index.add(xb[:10])  # the next search builds a new snapshot under the lock
    building, go = threading.Event(), threading.Event()
    snapshot = type(index)._snapshot

    def slow_snapshot(self):
        building.set()
        go.wait(30)
        return snapshot(self)

    index._snapshot = slow_snapshot.__get__(index)
    t = threading.Thread(target=index.search, args=(xq, 10))
    t.start()
    assert building.wait(30)
    threading.Timer(0.5, go.set).start()  # fork() waits for this search's lock to be freed
    pid = os.fork()
    if pid == 0:  # the child: search once, exit at once (no pytest teardown)
        code = 1
        try:
            del index._snapshot
            D, I = index.search(xq, 10)  # the fused call: the kernels' pool, no torch region
            code = 0 if I.shape == want[1].shape and (I >= 0).all() else 1
        finally:
            os._exit(code)
    t.join()
    del index._snapshot
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's search never returned (a lock held at the fork)")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
