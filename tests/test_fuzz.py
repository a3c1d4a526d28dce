"""The file fuzzer (tests/fuzz_files.py) over a fixed, seeded list of cases: every damaged or
crafted file ends in FormatError, an OSError, or loads and works - never a crash, a hang, a
MemoryError or another exception type. A count, not a time budget, so that the cases run do not
depend on the machine's speed; the long run is ``python -m tests.fuzz_files --cases N``."""

import json

from tests.fuzz_files import ALLOWED, run_fuzz

# ~40 s on one idle core; case 20,055 (a QJL header whose dim drew a 4096 x 4096 Haar matrix at
# load) is the highest case number that ever failed
CASES = 20_100


def test_fuzzed_files_fail_cleanly(tmp_path):
    report = run_fuzz(tmp_path, seed=0, cases=CASES, seconds=float("inf"), case_timeout=120,
                      memory_gb=4)
    assert report["cases"] == CASES, report
    assert set(report["outcomes"]) <= set(ALLOWED), json.dumps(report["failures"][:5], indent=1)
    assert not report["failures"]
    # the crafted kinds all ran, and some files survive them (loaded and searched)
    assert {"flip", "truncate", "splice", "header-set", "array-values", "huge"} <= set(
        report["mutations"])
    assert report["outcomes"].get("loaded", 0) > 0
