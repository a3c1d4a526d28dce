"""Search benchmark on digits, fashion-mnist and MiniLM: ``tqvec bench`` with the three sets
(MiniLM is built by datasets/minilm.py; a set that is missing is skipped).

    python bench/search.py [--dataset ...] [--nq 1000] [--skip PQ392x8 ...]

The benchmark itself lives in the package (tqvec/benchmark.py) so that ``tqvec bench`` runs it
from any install.
"""

from tqvec.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python bench/search.py",
                          datasets=("digits", "fashion-mnist-784-euclidean",
                                    "minilm-384-angular")))
