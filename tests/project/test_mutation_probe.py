"""The mutation probe stays runnable: every mutant's text is in the source exactly once, and every test it names
exists. A refactor that rewords a guarded line must update the probe, not leave a mutant that no longer applies."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from mutation_probe import MUTANTS, REPO, apply


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_applies_once_and_names_existing_tests(mutant):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path in [p for pattern in ("*.py", "*.cpp") for p in (REPO / "src").rglob(pattern)]:
            if mutant.old in path.read_text():
                (root / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
                (root / path.relative_to(REPO)).write_text(path.read_text())
        changed = apply(mutant, root)  # raises unless the text occurs exactly once under src/
        assert mutant.new in (root / changed).read_text()
    for test in mutant.tests:
        assert (REPO / test.split("::", 1)[0]).is_file(), test
