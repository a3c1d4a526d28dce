import subprocess
import sys

SNIPPET = """
import logging, sys
sys.modules['tqvec._C'] = None  # simulate a build without the compiled module
logging.basicConfig(level=logging.WARNING)
import numpy as np, tqvec
x = np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32)
c = tqvec.TurboQuant(16, 3)
c.encode(x); c.encode(x)
print(tqvec.available_backends())
try:
    tqvec.TurboQuant(16, 3, backend='cpu').encode(x)
except tqvec.BackendUnavailable as e:
    print('unavailable:', e)
"""


def test_import_falls_back_to_reference_and_warns_once():
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "('ref',)" in r.stdout
    assert "unavailable: backend 'cpu' needs the compiled module" in r.stdout
    assert r.stderr.count("using the torch reference ops") == 1


def test_import_needs_only_numpy_and_torch():
    code = ("import sys, numpy, torch; before = set(sys.modules); import tqvec; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new & {'faiss', 'sklearn', 'h5py', 'transformers', 'scipy', 'tqdm', "
            "'matplotlib', 'ray', 'pyarrow'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
