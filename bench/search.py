"""Search benchmark on digits, fashion-mnist and MiniLM into bench/results: ``tqvec bench`` with
the three sets (MiniLM is built by datasets/minilm.py; run it first) and every variant.

    python bench/search.py [--dataset ...] [--nq 1000] [--skip PQ392x8 ...]

The benchmark itself lives in the package (tqvec/benchmark.py) so that ``tqvec bench`` runs it
from any install.
"""

import os
import sys

from tqvec.benchmark import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--all" not in argv:
        argv = ["--all", *argv]
    raise SystemExit(main(argv, prog="python bench/search.py",
                          datasets=("digits", "fashion-mnist-784-euclidean",
                                    "minilm-384-angular"),
                          out=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           "results")))
