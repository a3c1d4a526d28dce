"""Distortion vs bits for every codec, against the TurboQuant paper's bounds.

    python bench/distortion.py [--n 4000] [--seeds 3]

For d in {64, 128, 384, 1536} and b = 1..4, on random unit vectors (the papers' setting,
averaged over --seeds seeds) and on real data (scikit-learn's digits, d = 64): the MSE
E||x - x_hat||^2 / ||x||^2 and the inner-product distortion d * E[(<q,x> - est)^2] for unit q,
x, next to the upper bound sqrt(3) pi / 2 * 4^-b (MSE; Theorem 1), sqrt(3) pi^2 * 4^-b (IP times
d; Theorem 2) and the lower bound 4^-b (Theorem 3). Writes bench/results/distortion.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DIMS = (64, 128, 384, 1536)
BITS = (1, 2, 3, 4)


def codecs_for(d: int, b: int, seed: int):
    import tqvec

    out = [("TurboQuant-mse", tqvec.TurboQuant(d, b, seed=seed)),
           ("TurboQuant-prod", tqvec.TurboQuant(d, b, "prod", seed=seed)),
           ("TurboQuant-prod (Gaussian S)", tqvec.TurboQuant(d, b, "prod", seed=seed,
                                                              jl="gaussian")),
           ("QJL (m = b*d)", tqvec.QJL(d, b * d, seed=seed))]
    if b == 4 and d % 16 == 0:  # PolarQuant's default (4,2,2,2) costs 3.875 bits/coordinate
        out.append(("PolarQuant (4,2,2,2)", tqvec.PolarQuant(d, seed=seed)))
    return out


def measure(codec, x: np.ndarray, q: np.ndarray) -> tuple[float, float, float]:
    """(relative MSE, d * mean squared IP error, mean IP error) for unit rows q_i, x_i paired."""
    codes = codec.encode(x)
    xh = codec.decode(codes, like=x)
    mse = float(((x - xh) ** 2).sum() / (x**2).sum())
    # Pair q_i with x_i: the diagonal of a block of scores, in chunks to bound memory.
    errs = []
    for s in range(0, len(x), 1000):
        e = min(len(x), s + 1000)
        est = np.diag(codec.score(q[s:e], codes[s:e]))
        errs.append(est - (q[s:e] * x[s:e]).sum(1))
    err = np.concatenate(errs)
    return mse, float(x.shape[1] * np.mean(err**2)), float(np.mean(err))


def unit(rng, n, d):
    v = rng.standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    a = ap.parse_args()
    if a.plot_only:
        with open(os.path.join(a.out, "distortion.json")) as f:
            plot(json.load(f)["rows"], os.path.join(a.out, "distortion.png"))
        return
    from _machine import machine_info

    from tqvec.datasets import load_embedded

    rows = []
    rng = np.random.default_rng(0)
    digits = load_embedded("digits")
    digits = digits / np.linalg.norm(digits, axis=1, keepdims=True)
    dq = digits[rng.permutation(len(digits))]
    sets = [(f"random d={d}", d) for d in DIMS] + [("digits d=64", 64)]
    for name, d in sets:
        for b in BITS:
            acc: dict[str, list[tuple[float, float, float]]] = {}
            for seed in range(a.seeds):
                if name.startswith("random"):
                    r = np.random.default_rng(1000 + seed)
                    x, q = unit(r, a.n, d), unit(r, a.n, d)
                else:
                    x, q = digits, dq
                for label, codec in codecs_for(d, b, seed):
                    acc.setdefault(label, []).append(measure(codec, x, q))
            for label, vals in acc.items():
                m = np.mean(vals, axis=0)
                c = codecs_for(d, b, 0)[[lb for lb, _ in codecs_for(d, b, 0)].index(label)][1]
                rows.append({"data": name, "d": d, "bits": b, "codec": label,
                             "bits_per_coord": 8 * c.code_size / d, "rel_mse": m[0],
                             "ip_distortion_times_d": m[1], "ip_bias": m[2],
                             "mse_upper": math.sqrt(3) * math.pi / 2 * 4.0**-b,
                             "mse_lower": 4.0**-b,
                             "ip_upper_times_d": math.sqrt(3) * math.pi**2 * 4.0**-b,
                             "ip_lower_times_d": 4.0**-b})
                print(f"{name:>14} b={b} {label:<30} mse {m[0]:.4f}  ip*d {m[1]:.4f}  "
                      f"bias {m[2]:+.5f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    result = {"n": a.n, "seeds": a.seeds, "rows": rows, "machine": machine_info()}
    with open(os.path.join(a.out, "distortion.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(rows, os.path.join(a.out, "distortion.md"), a)
    plot(rows, os.path.join(a.out, "distortion.png"))


def write_markdown(rows, path, a) -> None:
    lines = ["# Distortion vs bits", "",
             f"Command: `python bench/distortion.py --n {a.n} --seeds {a.seeds}`. Random unit "
             "vectors (mean over seeds) and scikit-learn digits (normalized). MSE = "
             "E||x - x_hat||^2 / ||x||^2; IP x d = d * E[(<q,x> - est)^2] for unit q, x.", "",
             "| data | b | codec | bits/coord stored | MSE | MSE bound (upper / lower) | "
             "IP x d | IP x d bound (upper / lower) | IP bias |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['data']} | {r['bits']} | {r['codec']} | {r['bits_per_coord']:.3f} | "
                     f"{r['rel_mse']:.4f} | {r['mse_upper']:.4f} / {r['mse_lower']:.4f} | "
                     f"{r['ip_distortion_times_d']:.4f} | {r['ip_upper_times_d']:.3f} / "
                     f"{r['ip_lower_times_d']:.4f} | {r['ip_bias']:+.5f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install tqvec[bench])")
        return
    b = np.array(BITS, dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"TurboQuant-mse": ("o-", "C0"), "TurboQuant-prod": ("s-", "C1"),
              "TurboQuant-prod (Gaussian S)": ("s--", "C2"), "QJL (m = b*d)": ("^-", "C3"),
              "PolarQuant (4,2,2,2)": ("D", "C4")}
    for ax, key, upper, title in (
            (axes[0], "rel_mse", math.sqrt(3) * math.pi / 2 * 4**-b, "MSE  E||x - x̂||² (unit x)"),
            (axes[1], "ip_distortion_times_d", math.sqrt(3) * math.pi**2 * 4**-b,
             "inner-product distortion  d·E[(<q,x> - est)²]")):
        ax.plot(b, upper, "k-", lw=2, label="upper bound (Thm 1 / 2)")
        ax.plot(b, 4**-b, "k:", lw=2, label="lower bound 4^-b (Thm 3)")
        for codec, (st, color) in styles.items():
            for d, alpha in ((128, 1.0), (1536, 0.45)):
                pts = [(r["bits_per_coord"] if codec.startswith("Polar") else r["bits"], r[key])
                       for r in rows if r["codec"] == codec and r["data"] == f"random d={d}"]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, st, color=color, alpha=alpha, label=f"{codec}, d={d}")
        ax.set_yscale("log")
        ax.set_xlabel("bits per coordinate")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower left")
    fig.suptitle("tqvec: measured distortion on random unit vectors vs the TurboQuant bounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
