"""The decode-attention op (softmax state over key and value codes) against tests/oracle.py
and its torch reference, as tests/test_ops.py does for the other ops."""

import numpy as np
import pytest
import torch

from tests import oracle
from tests.conftest import attn_case, on
from tqvec import ops


@pytest.mark.parametrize("bh,g,d,t,kb,vb", [(3, 4, 128, 700, 3, 3), (2, 1, 64, 300, 4, 2),
                                            (4, 8, 96, 257, 2, 4), (3, 3, 64, 50, 8, 1)])
def test_decode_attention_matches_reference(backend, bh, g, d, t, kb, vb, rng):
    """The softmax state (max, sum, rotated accumulator) of decode attention over codes; an
    empty token range gives (-inf, 0, 0)."""
    case = list(attn_case(rng, bh, g, d, t, kb, vb))
    m0, l0, a0 = ops.decode_attention(*case, backend="ref")
    m1, l1, a1 = ops.decode_attention(*on(backend, *case[:5]), kb, *on(backend, *case[6:9]), vb,
                                      *on(backend, *case[10:12]), case[12], backend=backend)
    m1, l1, a1 = m1.cpu(), l1.cpu(), a1.cpu()
    # the oracle in float64; a score is a d-term sum (error <= gamma(d) scale |q| |k|, at most
    # delta), exp(s - m) then carries a relative error <= 2 delta + u, the T-term sums gamma(T)
    # more: l and acc within (2 delta + gamma(T) + 2u) of their magnitudes, x2 slack. The CUDA
    # kernel runs on the tensor cores with fp16 operands (queries, centroids and the weights
    # rounded to fp16, float32 sums): u16 = 2^-11 more per operand.
    from tqvec.ops import cuda as cuda_ops
    u16 = 2.0 ** -11 if backend == "cuda" and cuda_ops.attention_kernel_applies(g, d, kb, vb) \
        else 0.0
    mo, lo, ao = oracle.attention_state(*case)
    q, kc = oracle.np64(case[0]), oracle.np64(case[4])
    delta = (oracle.gamma(d) + 2 * u16) * case[12] * np.abs(q).sum(-1).max() * np.abs(
        kc).max() * float(case[3].max())
    fin = np.isfinite(mo)
    assert (np.isfinite(m1.numpy()) == fin).all()
    assert np.allclose(m1.numpy()[fin], mo[fin], rtol=0, atol=2 * delta + 1e-6)
    rel = 2 * (2 * delta + oracle.gamma(t) + 2 * oracle.U + 2 * u16)
    assert (np.abs(l1.numpy() - lo) <= rel * lo + 1e-30).all()
    vmag = np.abs(oracle.np64(case[8])).max() * float(case[7].max())
    assert (np.abs(a1.numpy() - ao) <= rel * lo[..., None] * vmag + 1e-30).all()
    if backend == "cpu":  # the same float32 arithmetic as the reference
        torch.testing.assert_close(m1[torch.isfinite(m0)], m0[torch.isfinite(m0)], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a1, a0, rtol=1e-4, atol=1e-4)


def test_decode_attention_splits_large_work_between_threads(rng):
    """Work worth a second thread (tokens x query rows x d past the kernel's threshold) is split
    into parts whose softmax states are merged: the same state as one thread, within float
    rounding, and as the reference; a small call stays on one thread either way."""
    if "cpu" not in ops.available_backends():
        pytest.skip("tqvec._C not built")
    case = list(attn_case(rng, 2, 4, 128, 9000, 3, 3))
    m0, l0, a0 = ops.decode_attention(*case, backend="ref")
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(ops.decode_attention(*case, backend="cpu"))
    finally:
        torch.set_num_threads(threads)
    for m1, l1, a1 in got:
        torch.testing.assert_close(m1, m0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a1, a0, rtol=1e-4, atol=1e-4)
