"""The mutation check (tests/mutations.py, run on demand) stays applicable: every planted bug's
text occurs exactly once where it says, so a refactor that moves the code shows up here, not as a
'stale' row the next time someone runs the check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("tqvec_mutations", ROOT / "tests/mutations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.MUTANTS


@pytest.mark.parametrize("mutant", _mutants(), ids=lambda m: m.name)
def test_every_mutant_applies(mutant):
    for path, find, _ in mutant.edits:
        assert (ROOT / path).read_text().count(find) == 1, (mutant.name, path)
    for t in mutant.tests:
        assert (ROOT / t.split("::")[0]).is_file(), (mutant.name, t)
