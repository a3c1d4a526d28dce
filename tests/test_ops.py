"""Every op against an independent float64 oracle (tests/oracle.py: numpy, written from the
op's documented meaning, with the float32 rounding bound a result must meet), and every
compiled op against its torch reference (integers bit-exact, floats to the stated tolerance:
the kernels replay the reference's float32 operations). With ``backend="ref"`` only the oracle
comparison runs: the reference compared with itself proves nothing."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests import oracle
from tests.conftest import on, scan_case
from tqvec import ops
from tqvec.random import make_rotation

AWKWARD_D = [1, 2, 3, 7, 64, 96, 100, 128, 384, 769]


@given(b=st.integers(1, 8), d=st.integers(1, 300), n=st.integers(0, 9), seed=st.integers(0, 99))
def test_pack_unpack_roundtrip_and_cpu_equals_ref(b, d, n, seed):
    rng = np.random.default_rng(seed)
    idx = torch.from_numpy(rng.integers(0, 1 << b, size=(n, d)).astype(np.uint8))
    ref = ops.pack_bits(idx, b, backend="ref")
    assert ref.shape == (n, (d * b + 7) // 8) and ref.dtype == torch.uint8
    assert torch.equal(ops.unpack_bits(ref, d, b, backend="ref"), idx)
    if "cpu" in ops.available_backends():
        assert torch.equal(ops.pack_bits(idx, b, backend="cpu"), ref)
        assert torch.equal(ops.unpack_bits(ref, d, b, backend="cpu"), idx)


def test_packing_is_lsb_first():
    idx = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    # 2-bit fields 01, 10, 11 from bit 0 upwards: 0b00_11_10_01 = 0x39
    assert ops.pack_bits(idx, 2, backend="ref").tolist() == [[0x39]]
    # 3-bit fields straddle bytes: 001 010 011 -> stream 100 010 110 -> bytes 0xd1, 0x00
    assert ops.pack_bits(idx, 3, backend="ref").tolist() == [[0b11010001, 0b0]]


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("d", AWKWARD_D + [40, 200])  # + the vector path's partial blocks
def test_quantize_pack_matches_reference(backend, b, d, rng):
    n = 67
    y = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    scale = torch.from_numpy(rng.uniform(0.1, 3, n).astype(np.float32))
    thr = torch.from_numpy(np.sort(rng.standard_normal((1 << b) - 1)).astype(np.float32))
    # Put some values exactly on thresholds (after scaling): ties must go up, like searchsorted.
    y[0, : min(d, len(thr))] = thr[: min(d, len(thr))] / scale[0]
    # and past every threshold, both ways: the first index and the last
    y[1, : min(d, 2)] = torch.tensor([float("inf"), -float("inf")])[: min(d, 2)]
    ref = ops.quantize_pack(y, scale, thr, b, backend="ref")
    got = ops.quantize_pack(*on(backend, y, scale, thr), b, backend=backend).cpu()
    if backend != "ref":
        assert torch.equal(got, ref)
    # the oracle: index = #{t : thr[t] <= v} (ties go up), counted in numpy on the float32
    # product the op compares, unpacked by numpy's own bit order
    v = (y * scale[:, None]).numpy()
    want = (v[:, :, None] >= thr.numpy()[None, None, :]).sum(-1)
    assert (oracle.unpack(got, d, b) == want).all()


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [1, 7, 100, 769])
def test_centroid_stats_matches_reference(backend, b, d, rng):
    # float64 sums in another order, rounded to float32 once: equal up to that last rounding
    n = 41
    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))
    packed = ops.pack_bits(torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8)),
                           b, backend="ref")
    y = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    scale = torch.from_numpy(rng.uniform(0.1, 3, n).astype(np.float32))
    csq, dot = ops.centroid_stats(packed, d, b, c, y, scale, backend="ref")
    cc = c.double()[ops.unpack_bits(packed, d, b).long()]
    torch.testing.assert_close(csq, (cc * cc).sum(1).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(dot, ((y * scale[:, None]).double() * cc).sum(1).float(),
                               rtol=1e-6, atol=1e-6)
    got_csq, got_dot = ops.centroid_stats(on(backend, packed), d, b, *on(backend, c, y, scale),
                                          backend=backend)
    torch.testing.assert_close(got_csq.cpu(), csq, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_dot.cpu(), dot, rtol=1e-6, atol=1e-6)
    only, none = ops.centroid_stats(on(backend, packed), d, b, on(backend, c), backend=backend)
    assert none is None
    torch.testing.assert_close(only.cpu(), csq, rtol=1e-6, atol=0)
    empty, _ = ops.centroid_stats(on(backend, packed[:0]), d, b, on(backend, c),
                                  backend=backend)
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="y and scale together"):
        ops.centroid_stats(packed, d, b, c, y, backend=backend)


@pytest.mark.parametrize("fit", [False, True])
@pytest.mark.parametrize("b,d", [(1, 7), (3, 64), (3, 256), (4, 100), (8, 96)])
def test_turbo_mse_encode_is_the_steps_in_one_call(backend, b, d, fit, rng):
    """The rotation, the quantization by 1 / norm (0 for a zero row) and the fitted multiplier
    nrm <u, c> / ||c||^2 in one call: the same bits as those ops one by one on the same
    backend, and the reference's codes (multipliers to the centroid sums' last rounding)."""
    n = 37
    x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    x[5] = 0
    nrm = torch.linalg.vector_norm(x, dim=1)
    rot = make_rotation("hadamard", d, 3)
    thr = torch.from_numpy(np.sort(rng.standard_normal((1 << b) - 1)).astype(np.float32))
    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))
    args = (rot.perms, rot.signs, rot.p, thr, c, b, fit)
    packed, mult = ops.turbo_mse_encode(*on(backend, x, nrm), *on(backend, *args[:2]), rot.p,
                                        *on(backend, thr, c), b, fit, backend=backend)
    inv = torch.where(nrm > 0, nrm.reciprocal(), 0.0)
    y = ops.hadamard_rotate(*on(backend, x, rot.perms, rot.signs), rot.p, backend=backend)
    steps = ops.quantize_pack(y, *on(backend, inv, thr), b, backend=backend)
    assert torch.equal(packed.cpu(), steps.cpu())
    if fit:
        csq, dot = ops.centroid_stats(steps, d, b, on(backend, c), y, on(backend, inv),
                                      backend=backend)
        assert torch.equal(mult.cpu(), (on(backend, nrm) * dot / csq).cpu())
        assert mult[5] == 0
    else:
        assert mult is None
    ref_packed, ref_mult = ops.turbo_mse_encode(x, nrm, *args, backend="ref")
    assert torch.equal(packed.cpu(), ref_packed)
    if fit:
        torch.testing.assert_close(mult.cpu(), ref_mult, rtol=1e-6, atol=1e-7)
    empty, _ = ops.turbo_mse_encode(*on(backend, x[:0], nrm[:0]), *on(backend, *args[:2]),
                                    rot.p, *on(backend, thr, c), b, fit, backend=backend)
    assert empty.shape == (0, ops.row_bytes(d, b))


@pytest.mark.parametrize("b,d", [(1, 7), (2, 64), (3, 64), (3, 256), (4, 100), (8, 96),
                                 (3, 769)])
def test_turbo_mse_decode_is_the_steps_in_one_call(backend, b, d, rng):
    """The lookup of the centroids, the multiply by the row's multiplier and the inverse
    rotation in one call: bit for bit the reference's and the steps' one by one on the same
    backend (tail rows past a group of 8 and past a chunk included; a zero multiplier gives a
    zero row)."""
    n = 1037
    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))
    packed = ops.pack_bits(idx, b, backend="ref")
    mult = torch.from_numpy(rng.uniform(0.1, 3.0, n).astype(np.float32))
    mult[5] = 0
    rot = make_rotation("hadamard", d, 3)
    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))
    out = ops.turbo_mse_decode(*on(backend, packed, mult, rot.perms, rot.signs), rot.p,
                               on(backend, c), b, d, backend=backend)
    assert out.shape == (n, d) and out.dtype == torch.float32
    steps = ops.hadamard_rotate(on(backend, c)[ops.unpack_bits(on(backend, packed), d, b,
                                                               backend=backend).long()]
                                * on(backend, mult)[:, None],
                                *on(backend, rot.perms, rot.signs), rot.p, inverse=True,
                                backend=backend)
    assert torch.equal(out.cpu(), steps.cpu())
    ref = ops.turbo_mse_decode(packed, mult, rot.perms, rot.signs, rot.p, c, b, d, backend="ref")
    assert torch.equal(out.cpu(), ref)
    assert not out[5].any()
    empty = ops.turbo_mse_decode(*on(backend, packed[:0], mult[:0], rot.perms, rot.signs),
                                 rot.p, on(backend, c), b, d, backend=backend)
    assert empty.shape == (0, d)


@pytest.mark.parametrize("d", AWKWARD_D[1:] + [1536])
def test_hadamard_matches_reference_and_is_orthogonal(backend, d, rng):
    rot = make_rotation("hadamard", d, 7)
    x = torch.from_numpy(rng.standard_normal((33, d)).astype(np.float32))
    perms, signs = on(backend, rot.perms, rot.signs)
    ref = ops.hadamard_rotate(x, rot.perms, rot.signs, rot.p, backend="ref")
    got = ops.hadamard_rotate(on(backend, x), perms, signs, rot.p, backend=backend)
    if backend != "ref":
        assert torch.equal(got.cpu(), ref)
    # the oracle: the rotation's matrix built from its definition (scipy's Hadamard matrix);
    # each round's log2(p) butterfly stages round once each: |error| <= rounds (log2 p + 2) u
    # ||x||, x5 slack
    M = oracle.hadamard_matrix(rot.perms, rot.signs, rot.p, d)
    want = oracle.np64(x) @ M.T
    tol = 5 * 3 * (np.log2(rot.p) + 2) * oracle.U * np.linalg.norm(oracle.np64(x), axis=1)
    assert (np.abs(oracle.np64(got) - want) <= tol[:, None]).all()
    back = ops.hadamard_rotate(got, perms, signs, rot.p, inverse=True, backend=backend).cpu()
    got = got.cpu()
    assert torch.equal(back, ops.hadamard_rotate(got, rot.perms, rot.signs, rot.p, inverse=True,
                                                 backend="ref"))
    torch.testing.assert_close(back, x, atol=2e-5, rtol=0)
    m = rot.matrix().double()
    torch.testing.assert_close(m @ m.T, torch.eye(d, dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [1, 7, 9])
@pytest.mark.parametrize("d", [384, 784, 9, 8, 5])
def test_hadamard_partial_groups_are_bit_exact(backend, n, d, rng):
    # The CPU kernel rotates 8 rows interleaved and a partial group (one query) row by row,
    # the butterflies of h < 8 in registers (p >= 8; below that the portable loop).
    rot = make_rotation("hadamard", d, 3)
    x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    perms, signs = on(backend, rot.perms, rot.signs)
    for inverse in (False, True):
        ref = ops.hadamard_rotate(x, rot.perms, rot.signs, rot.p, inverse, backend="ref")
        got = ops.hadamard_rotate(on(backend, x), perms, signs, rot.p, inverse, backend=backend)
        assert torch.equal(got.cpu(), ref)


def test_ops_accept_empty_and_strided_inputs(backend, rng):
    y = torch.from_numpy(rng.standard_normal((10, 40)).astype(np.float32))[:, ::2]  # strided
    scale = torch.ones(10)
    thr = torch.tensor([-0.5, 0.0, 0.5])
    got = ops.quantize_pack(*on(backend, y, scale, thr), 2, backend=backend).cpu()
    assert torch.equal(got, ops.quantize_pack(y.contiguous(), scale, thr, 2, backend="ref"))
    empty = ops.quantize_pack(*on(backend, torch.zeros((0, 5)), torch.zeros(0), thr), 2,
                              backend=backend)
    assert empty.shape == (0, 2)


def test_unknown_and_unavailable_backends():
    from tqvec import BackendUnavailable

    idx = torch.zeros((2, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.pack_bits(idx, 2, backend="gpu")
    with pytest.raises(BackendUnavailable, match="cannot run on a cpu tensor"):
        ops.pack_bits(idx, 2, backend="cuda")


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d,n,nq", [(7, 50, 3), (100, 5000, 1), (96, 9000, 5), (384, 300, 40)])
def test_lut_scan_matches_reference(backend, b, d, n, nq, rng):
    """Scores within float-summation tolerance; positions equal up to ties."""
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, b, excluded_every=5)  # filtered rows
    k = 12 if n > 12 else n + 3  # also k > number of finite rows: -inf / -1 padding
    vr, pr = ops.lut_scan(qr, packed, c, mult, add, b, k, backend="ref")
    vc, pc = ops.lut_scan(*on(backend, qr, packed, c, mult, add), b, k, backend=backend)
    vc, pc = vc.cpu(), pc.cpu()
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, b)
    oracle.check_topk(vc, pc, s, bound, k)
    if backend != "ref":
        torch.testing.assert_close(vc, vr, rtol=1e-4, atol=1e-4)
        differ = pc != pr
        assert torch.equal(vc[differ].isfinite(), vr[differ].isfinite())


@pytest.mark.parametrize("b", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", [37, 64])
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000])
def test_block_codes_matches_reference(backend, b, d, n, rng):
    """Any width is transposed into 32-row blocks; b = 3 is re-laid out in pairs (3 bytes per
    8 coordinates, exactly the packed bytes when 8 divides d) and unblocks to the same codes."""
    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))
    packed = ops.pack_bits(idx, b, backend="ref")
    ref = ops.block_codes(packed, d, b, backend="ref")
    assert ref.shape == (-(-n // 32), ops.fast_scan_row_bytes(d, b), 32)
    if d % 8 == 0:
        assert ref.shape[1] == packed.shape[1]
    assert torch.equal(ops.ref.unblock_codes(ref, n, d, b), packed)
    if backend != "ref":
        assert torch.equal(ops.block_codes(on(backend, packed), d, b, backend=backend).cpu(), ref)
    with pytest.raises(ValueError, match="packed must be"):
        ops.block_codes(packed[:, 1:], d, b)


@pytest.mark.parametrize("b", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d,n", [(7, 1), (64, 33), (100, 200), (768, 70)])
def test_block_code_rows_is_block_codes_of_the_gathered_rows(backend, b, d, n, rng):
    """The layout of packed[rows] (-1: a zero row) without the gathered copy: equal to
    block_codes of the gathered rows (the reference's meaning), rows repeated and in any
    order."""
    idx = torch.from_numpy(rng.integers(0, 1 << b, (40, d)).astype(np.uint8))
    packed = ops.pack_bits(idx, b, backend="ref")
    rows = torch.from_numpy(rng.integers(-1, 40, n).astype(np.int32))
    gathered = packed[rows.long().clamp_min(0)].clone()
    gathered[rows < 0] = 0
    want = ops.block_codes(gathered, d, b, backend="ref")
    assert torch.equal(ops.block_code_rows(packed, rows, d, b, backend="ref"), want)
    if backend != "ref":
        got = ops.block_code_rows(on(backend, packed), on(backend, rows), d, b, backend=backend)
        assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="rows must be -1 or rows"):
        ops.block_code_rows(packed, torch.tensor([40], dtype=torch.int32), d, b)


def test_block_codes_pair_layout_of_three_bits():
    """b = 3, one group of 8 indices: hi nibbles of pairs in bytes 0-1, lo bits in byte 2."""
    idx = torch.tensor([[5, 2, 7, 0, 1, 6, 3, 4]], dtype=torch.uint8)
    bl = ops.block_codes(ops.pack_bits(idx, 3), 8, 3, backend="ref")[0, :, 0].tolist()
    hi = [(5 >> 1) | (2 >> 1) << 2, (7 >> 1) | (0 >> 1) << 2, (1 >> 1) | (6 >> 1) << 2,
          (3 >> 1) | (4 >> 1) << 2]
    lo = [1 | 0 << 1, 1 | 0 << 1, 1 | 0 << 1, 1 | 0 << 1]
    assert bl == [hi[0] | hi[1] << 4, hi[2] | hi[3] << 4,
                  lo[0] | lo[1] << 2 | lo[2] << 4 | lo[3] << 6]


@pytest.mark.parametrize("b", [1, 2, 3, 4])
@pytest.mark.parametrize("d,n,nq,k", [(7, 50, 3, 12), (100, 5000, 1, 10), (96, 9001, 5, 1),
                                      (384, 300, 40, 12), (1536, 4000, 2, 100), (64, 20, 2, 40)])
def test_fast_scan_matches_lut_scan_reference(backend, b, d, n, nq, k, rng):
    """The 7-bit-table scan re-scores a shortlist exactly: the same top k as the float scan,
    scores within float-summation tolerance (d = 1536, b = 4 exercises the Hoeffding bound;
    positions may differ only where scores tie within rounding)."""
    if backend == "cuda":
        pytest.skip("fast_scan is a CPU kernel (GPUs run the CUDA lut_scan)")
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, b, excluded_every=5)
    vr, pr = ops.lut_scan(qr, packed, c, mult, add, b, k, backend="ref")
    blocked = ops.block_codes(packed, d, b, backend="ref")
    vc, pc = ops.fast_scan(*on(backend, qr, blocked), n, *on(backend, c, mult, add), b, k,
                           backend=backend)
    vc, pc = vc.cpu(), pc.cpu()
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, b)
    oracle.check_topk(vc, pc, s, bound, k)
    if backend != "ref":  # the exact re-score replays lut_scan's float operations
        torch.testing.assert_close(vc, vr, rtol=1e-4, atol=1e-4)
    if backend == "cpu":  # a refinement's first stage: table scores, nothing re-scored
        scan = ops.FastScan([ops.ScanTerm(blocked, c, mult, b)], n, add)
        va, pa = scan.search([qr], k, approx=True)
        full, fp = ops.lut_scan(qr, packed, c, mult, add, b, n, backend="ref")
        spread = float(vr[torch.isfinite(vr)].abs().max())
        for i in range(nq):
            exact = dict(zip(fp[i].tolist(), full[i].tolist(), strict=True))
            got = [(float(v), int(r)) for v, r in zip(va[i], pa[i], strict=True) if r >= 0]
            assert len(got) == int((pr[i] >= 0).sum())
            assert all(np.isclose(v, exact[r], atol=0.05 * spread) for v, r in got)
            if got:  # and no pick far below the exact k-th best
                kth = float(vr[i][pr[i] >= 0][-1])
                assert all(exact[r] >= kth - 0.1 * spread for _, r in got)


@pytest.mark.parametrize("d,n,nq,k,case", [(1536, 4000, 16, 100, "normal"),
                                           (786, 1000, 9, 10, "normal"),
                                           (384, 3000, 8, 10, "spike"),
                                           (384, 3000, 8, 10, "sparse"),
                                           (100, 2000, 24, 40, "tiny"),
                                           (256, 3000, 8, 20, "skewed codebook")])
def test_fast_scan_batches_of_4_bit_codes_match_the_reference(d, n, nq, k, case, rng):
    """Batches of 4-bit codes (groups of 8 queries: the int8 dot form where the CPU has VNNI,
    the tables elsewhere) return the exact top k. Inputs the 8-bit weights and levels represent
    badly must widen the bound, not lose rows: one huge coordinate (the rest round to a few
    steps), mostly zero coordinates, tiny values, a codebook with one far outlier (the other
    levels crowd into a few steps); d = 1536 sums past 2^24, 786 coordinates end in an unpaired
    code byte."""
    if "cpu" not in ops.available_backends():
        pytest.skip("tqvec._C not built")
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, 4, excluded_every=7)
    if case == "spike":
        qr[:, 3] *= 1000.0
    elif case == "sparse":
        qr[:, 5:] = 0.0
    elif case == "tiny":
        qr *= 1e-30
    elif case == "skewed codebook":
        c = torch.cat([torch.tensor([-50.0]), torch.sort(torch.rand(15) * 0.1).values])
    blocked = ops.block_codes(packed, d, 4)
    vc, pc = ops.fast_scan(qr, blocked, n, c, mult, add, 4, k)
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, 4)
    oracle.check_topk(vc, pc, s, bound, k)
    vr, pr = ops.lut_scan(qr, packed, c, mult, add, 4, k, backend="ref")
    torch.testing.assert_close(vc, vr, rtol=1e-4, atol=1e-4 * float(vr.abs().max()))


@pytest.mark.parametrize("terms", [[(3, 100, 2), (1, 100, 1)], [(1, 64, 1), (1, 48, 1)],
                                   [(4, 384, 3), (1, 384, 1)], [(2, 33, 1)],
                                   [(3, 20, 1), (2, 7, 2), (1, 100, 1)],
                                   # mixed widths, the kernel's 8-term maximum
                                   [(4, 13, 1), (4, 13, 1), (4, 88, 1), (3, 150, 1),
                                    (2, 220, 1), (1, 174, 1), (1, 9, 1), (2, 2, 1)]])
@pytest.mark.parametrize("n,nq,k", [(5000, 3, 10), (777, 40, 25), (40, 2, 50)])
def test_fast_scan_terms_matches_reference(backend, terms, n, nq, k, rng):
    """Several codes per row (TurboQuant-prod: mse codes + QJL signs), each with its own width,
    dimension, centroids and signed multipliers: the same top k as the float reference."""
    if backend == "cuda":
        pytest.skip("fast_scan_terms is a CPU kernel")
    qrs, blocked, cents, mults, bits = [], [], [], [], []
    add = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    add[::7] = -float("inf")
    for b, d, _ in terms:
        qr, packed, c, mult, _ = scan_case(rng, nq, n, d, b, excluded_every=n + 1)
        if b == 1 and rng.random() < 0.5:
            c = torch.tensor([-1.0, 1.0])
        qrs.append(qr)
        blocked.append(ops.block_codes(packed, d, b, backend="ref"))
        cents.append(c)
        mults.append(mult * torch.from_numpy(rng.choice([-1.0, 1.0], n).astype(np.float32)))
        bits.append(b)
    v0, p0 = ops.ref.fast_scan_terms_ref(qrs, blocked, n, cents, mults, add, bits, k)
    v1, p1 = ops.fast_scan_terms(qrs, blocked, n, cents, mults, add, bits, k, backend=backend)
    # the oracle: the sum of each term's exact score, the bounds added (one more rounding per
    # term for the running sum)
    s, bound = oracle.np64(add)[None, :].repeat(nq, 0), 0.0
    for qr, bl, c, m, b in zip(qrs, blocked, cents, mults, bits, strict=True):
        packed = ops.ref.unblock_codes(bl, n, qr.shape[1], b)
        st, bt = oracle.lut_scores(qr, packed, c, m, torch.zeros(n), b)
        s, bound = s + st, bound + bt + 2 * oracle.U * np.abs(s + st)
    oracle.check_topk(v1, p1, s, bound, k)
    if backend != "ref":
        torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-4)
        assert (p1 == p0).float().mean() > 0.95  # positions differ only at near-ties


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 8])
def test_lut_rescore_matches_reference(backend, b, rng):
    """Only the listed rows (-1 = none, -inf offsets excluded) are scored: the top k of them."""
    if backend == "cuda":
        pytest.skip("lut_rescore is a CPU kernel (the reference runs on GPUs)")
    n, d, nq, r = 700, 37, 6, 50
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, b, excluded_every=9)
    rows = torch.from_numpy(np.stack([rng.choice(n, r, replace=False) for _ in range(nq)]))
    rows[:, -5:] = -1
    v0, p0 = ops.ref.lut_rescore_ref(qr, packed, c, mult, add, rows, b, 10)
    v1, p1 = ops.lut_rescore(qr, packed, c, mult, add, rows, b, 10, backend=backend)
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, b)
    oracle.check_topk(v1, p1, s, bound, 10, rows=rows)  # only the listed rows, excluded ones not
    if backend != "ref":
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
        assert (p1 == p0).float().mean() > 0.95


@pytest.mark.parametrize("b", [3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("d", [8, 24, 37, 784])
def test_lut_rescore_grid_codebook_matches_reference(backend, b, d, rng):
    """A grid codebook (sphere_grid_codebook: c[i] = hs (2 i - K + 1) exactly) is decoded by
    the CPU kernel affinely, hs * sum q_j (2 idx_j - K + 1), not gathered: the same scores as
    the reference's table lookups within float rounding, at every width and with d mod 16 of 0,
    8 and neither. A table one ulp off the grid is gathered (the general path), same scores."""
    if backend == "cuda":
        pytest.skip("lut_rescore is a CPU kernel (the reference runs on GPUs)")
    from tqvec.codebooks import grid_half_step, sphere_grid_codebook

    n, nq, r = 500, 5, 40
    qr, packed, _, mult, add = scan_case(rng, nq, n, d, b, excluded_every=9)
    c = torch.from_numpy(sphere_grid_codebook(max(d, 2), b).centroids.astype(np.float32))
    assert grid_half_step(c.numpy()) > 0
    off = c.clone()
    off[0] = torch.nextafter(off[0], torch.tensor(0.0))
    assert grid_half_step(off.numpy()) == 0.0
    rows = torch.from_numpy(np.stack([rng.choice(n, r, replace=False) for _ in range(nq)]))
    rows[:, -3:] = -1
    for cb in (c, off):
        v0, p0 = ops.ref.lut_rescore_ref(qr, packed, cb, mult, add, rows, b, 10)
        v1, p1 = ops.lut_rescore(qr, packed, cb, mult, add, rows, b, 10, backend=backend)
        s, bound = oracle.lut_scores(qr, packed, cb, mult, add, b)
        oracle.check_topk(v1, p1, s, bound, 10, rows=rows)
        if backend != "ref":
            torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5 * max(1.0, d ** 0.5 / 4))
            assert (p1 == p0).float().mean() > 0.95


@pytest.mark.parametrize("b,grid", [(2, False), (3, False), (4, False), (8, False), (3, True),
                                    (8, True)])
def test_fast_scan_two_stage(backend, b, grid, rng):
    """With k1 >= n every row reaches the second stage: exactly lut_scan's top k. With a small
    k1 the results are exact full-code scores of rows the sign pass ranked high. A grid
    codebook's second stage decodes affinely (lut_rescore's path)."""
    if backend == "cuda":
        pytest.skip("fast_scan_two_stage is a CPU kernel")
    n, d, nq, k = 3000, 64, 5, 10
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, b, excluded_every=11)
    if grid:
        from tqvec.codebooks import sphere_grid_codebook

        c = torch.from_numpy(sphere_grid_codebook(d, b).centroids.astype(np.float32))
    idx = ops.unpack_bits(packed, d, b)
    signs = ops.block_codes(ops.pack_bits(idx >> (b - 1), 1), d, 1)
    c1 = torch.tensor([-1.0, 1.0]) * c.abs().mean()
    v, p = ops.fast_scan_two_stage(qr, signs, n, c1, packed, b, c, mult, add, add, n, k,
                                   backend=backend)
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, b)
    oracle.check_topk(v, p, s, bound, k)  # every row reaches the second stage: exact top k
    add1 = torch.where(torch.isinf(add), add, torch.zeros_like(add))  # its own offsets
    v, p = ops.fast_scan_two_stage(qr, signs, n, c1, packed, b, c, mult, add, add1, 200, k,
                                   backend=backend)
    exact = torch.stack([ops.ref.lut_rescore_ref(qr[i:i + 1], packed, c, mult, add, p[i:i + 1],
                                                 b, k)[0][0] for i in range(nq)])
    torch.testing.assert_close(v, exact, rtol=1e-5, atol=1e-5)  # full-code scores, best first
    assert not torch.isin(p, torch.arange(0, n, 11)).any()
    _, cand = ops.ref.fast_scan_ref(qr, signs, n, c1, mult, add1, 1, 200)
    assert np.mean([len(set(p[i].tolist()) & set(cand[i].tolist())) / k for i in range(nq)]) > 0.9
    # the first pass's own per-row multipliers (mult1): its candidates follow them, the
    # second stage keeps the full codes' mult
    mult1 = torch.where(torch.arange(n) % 2 == 0, mult, -mult)  # odd rows' signs flipped
    v, p = ops.fast_scan_two_stage(qr, signs, n, c1, packed, b, c, mult, add, add1, 200, k,
                                   backend=backend, mult1=mult1)
    _, cand1 = ops.ref.fast_scan_ref(qr, signs, n, c1, mult1, add1, 1, 200)
    assert np.mean([len(set(p[i].tolist()) & set(cand1[i].tolist())) / k
                    for i in range(nq)]) > 0.9
    exact = torch.stack([ops.ref.lut_rescore_ref(qr[i:i + 1], packed, c, mult, add, p[i:i + 1],
                                                 b, k)[0][0] for i in range(nq)])
    torch.testing.assert_close(v, exact, rtol=1e-5, atol=1e-5)
    vr, pr = ops.ref.fast_scan_two_stage_ref(qr, signs, n, c1, packed, b, c, mult, add, add1,
                                             200, k, mult1)
    assert (p == pr).float().mean() > 0.9


@pytest.mark.parametrize("d", [64, 72, 100])
def test_fast_scan_two_stage_prefix(backend, d, rng):
    """1-bit codes: the first pass scans a prefix of the coordinates (d1 = 8 * its bytes per
    row). With k1 >= n, lut_scan's exact top k; with a small k1, the candidates are those of
    the reference's prefix pass (up to ties at the k1-th place) and scored with the full codes.
    A plane wider than the codes, or not a whole prefix, is refused."""
    if backend == "cuda":
        pytest.skip("fast_scan_two_stage is a CPU kernel")
    n, nq, k = 3000, 5, 10
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, 1, excluded_every=13)
    nbytes = (-(-d // 8) + 1) // 2
    signs = ops.block_codes(packed[:, :nbytes].contiguous(), 8 * nbytes, 1)
    add1 = torch.where(torch.isinf(add), add, add * (8 * nbytes / d))
    v, p = ops.fast_scan_two_stage(qr, signs, n, c, packed, 1, c, mult, add, add1, n, k,
                                   backend=backend)
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, 1)
    oracle.check_topk(v, p, s, bound, k)
    v, p = ops.fast_scan_two_stage(qr, signs, n, c, packed, 1, c, mult, add, add1, 100, k,
                                   backend=backend)
    exact = torch.stack([ops.ref.lut_rescore_ref(qr[i:i + 1], packed, c, mult, add, p[i:i + 1],
                                                 1, k)[0][0] for i in range(nq)])
    torch.testing.assert_close(v, exact, rtol=1e-5, atol=1e-5)
    assert not torch.isin(p, torch.arange(0, n, 13)).any()
    vr, pr = ops.ref.fast_scan_two_stage_ref(qr, signs, n, c, packed, 1, c, mult, add, add1,
                                             100, k)
    assert (p == pr).float().mean() > 0.9
    wide = ops.block_codes(ops.pack_bits(torch.zeros((n, d + 16), dtype=torch.uint8), 1),
                           d + 16, 1)
    with pytest.raises((ValueError, RuntimeError), match="signs must"):
        ops.fast_scan_two_stage(qr, wide, n, c, packed, 1, c, mult, add, add1, 100, k,
                                backend=backend)


@pytest.mark.parametrize("d1_bytes", [4, 8])
def test_fast_scan_two_stage_few_queries_path(d1_bytes, rng):
    """A few queries (fewer than 3 per thread) store every first-pass score and select the k1
    best once; more queries keep shortlists. Both keep the same rows (the k1 best approximate
    scores, ties included), so one query at a time gives the batch's results; k1 >= n (a
    threshold sample that leaves too few rows falls back to every finite row) is exact. At
    6,000 rows the shortlists start from a threshold sampled on a few runs of blocks; rows whose
    scores fall with their position put the best rows in the first run, where that threshold
    leaves fewer than k1 rows and the query is scanned again."""
    if "cpu" not in ops.available_backends():
        pytest.skip("compiled CPU kernels not built")
    n, d, nq, k = 6000, 64, 8, 10
    qr, packed, c, mult, add = scan_case(rng, nq, n, d, 1, excluded_every=7)
    signs = ops.block_codes(packed[:, :d1_bytes].contiguous(), 8 * d1_bytes, 1)
    add1 = torch.where(torch.isinf(add), add, torch.zeros_like(add))
    high = add1.clone()
    high[::64] += 1000.0  # the threshold's sample (rows 0, 64, ...) leads: too few survive
    falling = add1 + torch.linspace(1000.0, 0.0, n)  # the first rows lead
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for k1, first in ((37, add1), (300, add1), (n, add1), (300, high), (37, falling),
                          (300, falling)):
            vb, pb = ops.fast_scan_two_stage(qr, signs, n, c, packed, 1, c, mult, add, first, k1,
                                             k, backend="cpu")  # 8 queries: shortlists
            for i in range(nq):  # one query: stored scores
                v1, p1 = ops.fast_scan_two_stage(qr[i:i + 1], signs, n, c, packed, 1, c, mult,
                                                 add, first, k1, k, backend="cpu")
                torch.testing.assert_close(v1[0], vb[i], rtol=0, atol=0)
                assert torch.equal(p1[0], pb[i])
            if k1 == n:
                vx, _ = ops.lut_scan(qr, packed, c, mult, add, 1, k, backend="ref")
                torch.testing.assert_close(vb, vx, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n,d,m", [(1, 784, 391), (9, 96, 43), (37, 33, 7), (0, 5, 3)])
def test_row_project_matches_reference(backend, n, d, m, rng):
    """x W (a PCA index's query map): within float rounding of the float64 product (each
    entry a d-term sum, gamma(d) sum |x_j W_jc|), every tile width and remainder."""
    x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    W = torch.from_numpy(rng.standard_normal((d, m)).astype(np.float32))
    out = ops.row_project(*on(backend, x, W), backend=backend).cpu()
    assert out.shape == (n, m) and out.dtype == torch.float32
    exact = x.double() @ W.double()
    bound = oracle.gamma(d) * (x.double().abs() @ W.double().abs())
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()
    with pytest.raises(ValueError, match="W"):
        ops.row_project(x, W[:-1] if d > 1 else W.T, backend=backend)




def test_fast_scan_terms_rejects_bad_terms(rng):
    qr, packed, c, mult, add = scan_case(rng, 2, 64, 16, 2, excluded_every=5)
    bl = ops.block_codes(packed, 16, 2)
    with pytest.raises(ValueError, match="1 to 8 terms"):
        ops.fast_scan_terms([qr, qr], [bl], 64, [c], [mult], add, [2], 5)
    with pytest.raises(ValueError, match="1 to 8 terms"):
        ops.fast_scan_terms([qr] * 9, [bl] * 9, 64, [c] * 9, [mult] * 9, add, [2] * 9, 5)
    with pytest.raises(ValueError, match="bits must be in"):
        ops.fast_scan_terms([qr, qr], [bl, bl], 64, [c, c], [mult, mult], add, [2, 5], 5)


def test_fast_scan_many_tied_scores(rng):
    """Rows drawn from 5 distinct codes: hundreds of equal scores around the k-th, which the
    shortlist's compactions (branch-free three-way quickselect) must split exactly — the best
    k values, ties to the lower position, as a stable sort of the reference scores gives."""
    if "cpu" not in ops.available_backends():
        pytest.skip("tqvec._C not built")
    n, d, b, k = 3000, 64, 2, 60
    distinct = torch.from_numpy(rng.integers(0, 1 << b, (5, d)).astype(np.uint8))
    idx = distinct[torch.from_numpy(rng.integers(0, 5, n))]
    packed = ops.pack_bits(idx, b)
    qr = torch.from_numpy(rng.standard_normal((2, d)).astype(np.float32))
    c = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    scores = ops.ref.lut_scan_ref(qr, packed, c, torch.ones(n), torch.zeros(n), b, n)[0]
    v, p = ops.fast_scan(qr, ops.block_codes(packed, d, b), n, c, torch.ones(n), torch.zeros(n),
                         b, k)
    exact = (qr @ c[idx.long()].T).numpy()  # (2, n), equal for equal rows
    for i in range(2):
        want = np.argsort(-exact[i], kind="stable")[:k]
        assert np.array_equal(np.sort(exact[i][p[i].numpy()]), np.sort(exact[i][want]))
        assert np.array_equal(p[i].numpy(), want)
        torch.testing.assert_close(v[i], scores[i][:k], rtol=1e-5, atol=1e-5)


def test_fast_scan_constant_scores_and_bad_bits(rng):
    """All rows equal (every table flat): ties broken by the lower position, like topk."""
    n, d = 100, 16
    packed = torch.zeros((n, ops.row_bytes(d, 2)), dtype=torch.uint8)
    qr = torch.zeros((1, d))
    v, p = ops.fast_scan(qr, ops.block_codes(packed, d, 2), n, torch.tensor([-1.5, -0.5, 0.5, 1.5]),
                         torch.ones(n), torch.zeros(n), 2, 5)
    assert v.tolist() == [[0.0] * 5]
    if "cpu" in ops.available_backends():
        assert p.tolist() == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="b must be one of"):
        ops.fast_scan(qr, ops.block_codes(packed, d, 2), n, torch.zeros(32), torch.ones(n),
                      torch.zeros(n), 5, 5)


@pytest.mark.parametrize("b", [1, 2, 4])
@pytest.mark.parametrize("approx", [False, True])
def test_fast_scan_keeps_rows_just_above_the_threshold(b, approx):
    """Rows with the same code and multipliers rising by 1e-5 per row: each block's rows beat
    the threshold the rows before them set by a hair, so a scan that skips blocks by a bound
    on their table sums (the VNNI path) must not skip any of them; the best k are the last k
    rows for a query that scores the code above zero (the first k below zero)."""
    if "cpu" not in ops.available_backends():
        pytest.skip("compiled module missing")
    rng = np.random.default_rng(b)
    d, n, k = 96, 2000, 10
    idx = torch.from_numpy(np.tile(rng.integers(0, 1 << b, (1, d)), (n, 1)).astype(np.uint8))
    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))
    mult = torch.from_numpy((1.0 + 1e-5 * np.arange(n)).astype(np.float32))
    fs = ops.FastScan([ops.ScanTerm(ops.block_codes(ops.pack_bits(idx, b), d, b), c, mult, b)],
                      n, torch.zeros(n))
    # queries along +-c[idx] (far from a zero score, which the tables could not resolve)
    sign = np.where(np.arange(13) % 2 == 0, 1.0, -1.0)[:, None]
    qr = torch.from_numpy((sign * (c[idx[0].long()].numpy() + 0.3 * rng.standard_normal(
        (13, d)))).astype(np.float32))
    u = (qr.double() @ c.double()[idx[0].long()]).numpy()  # every row's <q, c[idx]>
    for q in (qr, qr[:1]):
        _, pos = fs.search([q], k, approx=approx)
        for i in range(len(q)):
            want = np.arange(n - 1, n - 1 - k, -1) if u[i] > 0 else np.arange(k)
            assert pos[i].tolist() == want.tolist(), (i, u[i])
