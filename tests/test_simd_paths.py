"""Every SIMD path of the CPU kernels gives the portable loops' bits: each op run in processes
with TQVEC_SIMD=auto / avx2 / avx512 / scalar, outputs compared exactly."""

import subprocess
import sys

import numpy as np
import pytest

from tqvec import ops


def test_fast_scan_scalar_path_equals_simd_path(tmp_path):
    """Every vector path this CPU has (the default: AVX2, with VBMI's 3-bit scans and VNNI's
    4-bit dot scans where the CPU has them; AVX2 alone with TQVEC_SIMD=avx2; AVX-512 with
    TQVEC_SIMD=avx512; the portable loops with TQVEC_SIMD=scalar; chosen once per process)
    gives the same results:
    flat and IVF scans, the exact re-score of Refine(Flat) and of packed codes (lut_rescore,
    every width, table and grid codebooks), a one-row rotation, the probe's register tiles,
    ||q||^2 and <q, v>, the query map x W, and decode attention over key and value codes of
    every width (its softmax state, and a whole compiled decode step)."""
    if "cpu" not in ops.available_backends():
        pytest.skip("compiled module missing")

    script = (
        "import numpy as np, torch, sys\n"
        "from tqvec import ops\n"
        "from tqvec.codebooks import sphere_grid_codebook\n"
        "rng = np.random.default_rng(3)\n"
        "out = []\n"
        "for b, d, n in [(1, 100, 1000), (2, 96, 777), (3, 100, 999), (4, 384, 2000)]:\n"
        "    qr = torch.from_numpy(rng.standard_normal((3, d)).astype(np.float32))\n"
        "    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))\n"
        "    bl = ops.block_codes(ops.pack_bits(idx, b), d, b)\n"
        "    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))\n"
        "    v, p = ops.fast_scan(qr, bl, n, c, torch.ones(n), torch.zeros(n), b, 10)\n"
        "    out += [v.numpy(), p.numpy()]\n"
        "    lb = torch.tensor([0, 3, 3, bl.shape[0]])\n"
        "    probes = torch.tensor([[0, 2], [2, -1], [1, 0]])\n"
        "    off = torch.from_numpy(rng.standard_normal((3, 2)).astype(np.float32))\n"
        "    v, p = ops.fast_scan_terms([qr, qr[:, :50]], [bl, ops.block_codes(\n"
        "        ops.pack_bits(idx[:, :50] & 1, 1), 50, 1)], n, [c, torch.tensor([-1., 1.])],\n"
        "        [torch.ones(n), -0.5 * torch.ones(n)], torch.zeros(n), [b, 1], 10)\n"
        "    out += [v.numpy(), p.numpy()]\n"
        "    v, p = ops.ivf_fast_scan(qr, bl, c, torch.ones(32 * bl.shape[0]),\n"
        "                             torch.zeros(32 * bl.shape[0]), lb, probes, off, b, 10)\n"
        "    out += [v.numpy(), p.numpy()]\n"
        "    rot = __import__('tqvec.random').random.make_rotation('hadamard', d, 1)\n"
        "    out.append(ops.hadamard_rotate(qr[:1], rot.perms, rot.signs, rot.p).numpy())\n"
        "    out.append(ops.row_sqnorms(qr).numpy())\n"
        "    out.append(ops.row_dots(qr, qr[0]).numpy())\n"
        "    for bb, dd in [(1, d), (2, d), (3, 37), (4, d), (5, 50), (6, 24), (7, 40), (8, d),\n"
        "                   (8, 13)]:\n"
        "        ii = torch.from_numpy(rng.integers(0, 1 << bb, (n, dd)).astype(np.uint8))\n"
        "        cc = torch.from_numpy(np.sort(rng.standard_normal(1 << bb)).astype(np.float32))\n"
        "        cg = torch.from_numpy(sphere_grid_codebook(max(dd, 2), bb).centroids.astype(\n"
        "            np.float32))\n"
        "        qq = torch.from_numpy(rng.standard_normal((3, dd)).astype(np.float32))\n"
        "        rr = torch.from_numpy(rng.integers(-1, n, (3, 30)))\n"
        "        for cb in (cc, cg):\n"
        "            out += [t.numpy() for t in ops.lut_rescore(qq, ops.pack_bits(ii, bb), cb,\n"
        "                torch.ones(n), torch.zeros(n), rr, bb, 10)]\n"
        "    rows = torch.from_numpy(rng.integers(-1, n, (3, 40)))\n"
        "    for metric in ('ip', 'l2', 'cosine'):\n"
        "        out += [t.numpy() for t in ops.rescore_topk(qr, qr.new_tensor(\n"
        "            rng.standard_normal((n, d)).astype(np.float32)), rows, metric, 10)]\n"
        "    qs = torch.from_numpy(rng.standard_normal((10, d)).astype(np.float32))\n"
        "    cs = torch.from_numpy(rng.standard_normal((11, d)).astype(np.float32))\n"
        "    out += [t.numpy() for t in ops.ivf_probe(qs, cs, (cs * cs).sum(1), True, 3)]\n"
        "    wm = torch.from_numpy(rng.standard_normal((d, 43)).astype(np.float32))\n"
        "    out += [ops.row_project(qs, wm).numpy(), ops.row_project(qs[:3], wm[:, :5]).numpy()]\n"
        "    for bb, dq in [(3, d), (5, d), (8, d), (8, 40), (6, 200)]:  # quantization: compare\n"
        "        # passes (b <= 4), binary search above (8 x 4 coordinates a step, and fewer)\n"
        "        yy = torch.from_numpy(rng.standard_normal((9, dq)).astype(np.float32))\n"
        "        th = torch.from_numpy(np.sort(rng.standard_normal((1 << bb) - 1)).astype(\n"
        "            np.float32))\n"
        "        yy[0, :5] = th[:5]\n"
        "        yy[1, :3] = torch.tensor([float('inf'), -float('inf'), float('nan')])\n"
        "        out.append(ops.quantize_pack(yy, torch.ones(9), th, bb).numpy())\n"
        "for b, d, n in [(1, 100, 1000), (2, 96, 777), (3, 1040, 1100), (4, 786, 1100),\n"
        "                (1, 120, 1000), (2, 92, 700), (4, 388, 500)]:\n"
        "    # 13 queries: groups of several queries per pass and a remainder; 786 4-bit\n"
        "    # coordinates: an odd byte count past a 16-bit flush; 13, 24, 15, 23, 194 code\n"
        "    # bytes: every remainder of the VNNI sums' four bytes per step\n"
        "    qr = torch.from_numpy(rng.standard_normal((13, d)).astype(np.float32))\n"
        "    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))\n"
        "    bl = ops.block_codes(ops.pack_bits(idx, b), d, b)\n"
        "    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))\n"
        "    mult = torch.from_numpy(rng.uniform(0.5, 2, n).astype(np.float32))\n"
        "    add = torch.from_numpy(rng.standard_normal(n).astype(np.float32))\n"
        "    out += [t.numpy() for t in ops.fast_scan(qr, bl, n, c, mult, add, b, 10)]\n"
        "    nb = bl.shape[0]\n"
        "    lb = torch.tensor([0, nb // 4, nb // 2, nb // 2 + 1, nb])\n"
        "    probes = torch.from_numpy(np.stack([rng.permutation(4)[:2] for _ in range(13)]))\n"
        "    off = torch.from_numpy(rng.standard_normal((13, 2)).astype(np.float32))\n"
        "    pad = torch.full((32 * nb - n,), -float('inf'))\n"
        "    m2, a2 = torch.cat([mult, torch.ones_like(pad)]), torch.cat([add, pad])\n"
        "    out += [t.numpy() for t in ops.ivf_fast_scan(qr, bl, c, m2, a2, lb, probes, off,\n"
        "                                                 b, 10)]\n"
        "    # the approximate scans return the table scores: the totals themselves, bit for bit\n"
        "    fs = ops.FastScan([ops.ScanTerm(bl, c, mult, b)], n, add)\n"
        "    for qq in (qr, qr[:1]):\n"
        "        out += [t.numpy() for t in fs.search([qq], 10, approx=True)]\n"
        "    out += [t.numpy() for t in ops.ivf_fast_scan(qr, bl, c, m2, a2, lb, probes, off,\n"
        "                                                 b, 10, approx=True)]\n"
        "# decode attention over codes: every width the KV cache stores, d with a tail\n"
        "for kb, vb, d in [(3, 3, 128), (4, 2, 100), (2, 4, 72), (8, 1, 96), (1, 8, 44)]:\n"
        "    qr = torch.from_numpy(rng.standard_normal((2, 3, d)).astype(np.float32))\n"
        "    qb = torch.from_numpy(rng.standard_normal((2, 3)).astype(np.float32))\n"
        "    kp = ops.pack_bits(torch.from_numpy(rng.integers(0, 1 << kb, (600, d)).astype(\n"
        "        np.uint8)), kb).reshape(2, 300, -1)\n"
        "    vp = ops.pack_bits(torch.from_numpy(rng.integers(0, 1 << vb, (600, d)).astype(\n"
        "        np.uint8)), vb).reshape(2, 300, -1)\n"
        "    kn, vn = (torch.from_numpy(rng.uniform(0.5, 2, (2, 300)).astype(np.float32))\n"
        "              for _ in range(2))\n"
        "    kc, vc = (torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))\n"
        "              for b in (kb, vb))\n"
        "    lo, hi = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([300, 299],\n"
        "                                                                  dtype=torch.int32)\n"
        "    out += [t.numpy() for t in ops.decode_attention(qr, qb, kp, kn, kc, kb, vp, vn, vc,\n"
        "                                                     vb, lo, hi, 0.1, backend='cpu')]\n"
        "    # a whole decode step: both code sides, float16 multipliers, exact float16 rows\n"
        "    rot = __import__('tqvec.random').random.make_rotation('hadamard', d, 5)\n"
        "    ks, vs = (ops.KVSide(ops.HadamardRotate(rot.perms, rot.signs, rot.p), c, b)\n"
        "              for c, b in ((kc, kb), (vc, vb)))\n"
        "    ex = torch.from_numpy(rng.standard_normal((2, 5, d)).astype(np.float16))\n"
        "    seg = ops.KVCodeSegment(ks, vs, kp, kn.half(), vp, vn.half())\n"
        "    plan = ops.KVStepPlan(2, 2, d, torch.float16, [seg], (ex[:, :2], ex[:, 3:]))\n"
        "    out.append(ops.attention_step(qr, 0.1, plan, [7, 299], [(ex, ex.flip(1))],\n"
        "                                  backend='cpu').numpy())\n"
        "    assert plan.prepared['cpu'] is not None  # the compiled step ran\n"
        "out.append(np.array([ops.simd_path()]))\n"
        "np.savez(sys.argv[1], *out)\n")
    env = dict(__import__("os").environ)
    res = {}
    for mode in ("auto", "avx2", "avx512", "scalar"):
        env["TQVEC_SIMD"] = mode
        path = tmp_path / f"{mode}.npz"
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True)
        res[mode] = dict(np.load(path))
    last = f"arr_{len(res['auto']) - 1}"
    paths = {mode: str(r.pop(last)[0]) for mode, r in res.items()}
    fast = ("avx2+vbmi+vnni", "avx2+vbmi", "avx2", "scalar")  # what the CPU has of them
    assert paths["scalar"] == "scalar" and paths["auto"] in fast
    assert paths["avx2"] in ("avx2", "scalar")
    assert paths["avx512"] in ("avx512", *fast)
    for mode in ("avx2", "avx512", "scalar"):
        for key in res["auto"]:
            np.testing.assert_array_equal(res["auto"][key], res[mode][key], err_msg=(
                f"{paths['auto']} vs {paths[mode]}, {key}"))
