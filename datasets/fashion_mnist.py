"""Recipe: build fashion-mnist-784-euclidean.hdf5 (ann-benchmarks layout) offline.

    apt-get install dataset-fashion-mnist        # or have the four idx .gz files in a folder
    python datasets/fashion_mnist.py [--src DIR] [--out FILE]

Base = the 60,000 training images, queries = the 10,000 test images, float32 784-d raw pixel
values, L2 distance, exact top-100 ground truth. Output defaults to $TQVEC_DATA or
~/.cache/tqvec (never this repository).
"""

import argparse

from tqvec.datasets import build_fashion_mnist

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--src", default=None, help="folder with the idx .gz files")
    ap.add_argument("--out", default=None, help="output .hdf5 path")
    a = ap.parse_args()
    print(build_fashion_mnist(a.src, a.out))
