"""Every planted bug of scripts/mutants.py still applies: its old text occurs exactly once.

A change that rewords the code a mutant plants into would otherwise turn that mutant into
a no-op that `scripts/mutants.py` reports as not applying only when someone runs it."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutant_still_applies() -> None:
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    assert len(mutants.MUTANTS) >= 40
    assert mutants.stale(list(mutants.MUTANTS)) == []
