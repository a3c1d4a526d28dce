"""Search benchmark on the embedded digits and fashion-mnist: ``tqvec bench`` with both sets.

    python bench/search.py [--dataset ...] [--nq 1000] [--skip PQ392x8 ...]

The benchmark itself lives in the package (tqvec/benchmark.py) so that ``tqvec bench`` runs it
from any install.
"""

from tqvec.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python bench/search.py",
                          datasets=("digits", "fashion-mnist-784-euclidean")))
