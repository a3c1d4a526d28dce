#!/usr/bin/env bash
# Put tqvec into an ann-benchmarks checkout: the algorithm definition (module.py, config.yml,
# Dockerfile) and a source archive of this tree for the Docker build.
#     bench/ann_benchmarks/install.sh /path/to/ann-benchmarks
# Then, in the checkout: `python run.py --local --algorithm tqvec --dataset ...` (tqvec
# installed in that Python), or build the image (see the Dockerfile) and run without --local.
set -euo pipefail
harness="${1:?usage: install.sh /path/to/ann-benchmarks}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="$harness/ann_benchmarks/algorithms/tqvec"
mkdir -p "$dest"
cp "$here/module.py" "$here/config.yml" "$here/Dockerfile" "$dest/"
# the tracked files of this checkout, as the image builds them (no build output, no data)
git -C "$root" archive --format=tar.gz --prefix=tqvec/ -o "$dest/tqvec-src.tar.gz" HEAD
echo "tqvec installed in $dest"
