"""The file fuzzer (tests/fuzz_files.py) for one minute: every damaged or crafted file ends in
FormatError, an OSError, or loads and works - never a crash, a hang, a MemoryError or another
exception type."""

import json

from tests.fuzz_files import ALLOWED, run_fuzz


def test_fuzzed_files_fail_cleanly(tmp_path):
    report = run_fuzz(tmp_path, seed=0, cases=10**7, seconds=60, case_timeout=30, memory_gb=4)
    assert report["cases"] >= 1000, report  # ~1,000 cases a second here
    assert set(report["outcomes"]) <= set(ALLOWED), json.dumps(report["failures"][:5], indent=1)
    assert not report["failures"]
    # the crafted kinds all ran, and some files survive them (loaded and searched)
    assert {"flip", "truncate", "splice", "header-set", "array-values", "huge"} <= set(
        report["mutations"])
    assert report["outcomes"].get("loaded", 0) > 0
