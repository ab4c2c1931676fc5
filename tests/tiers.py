"""The suite's tiers: the smoke tier (``pytest -m smoke``: under a minute, after every edit), the quick loop
(``pytest -q``: no test marked ``slow`` or ``full``, and fewer Hypothesis examples) and every tier
(``pytest -q --full``: what ``.ci/run`` runs). Tests named on the command line, or chosen by ``-m``, run
whatever their marks."""

from __future__ import annotations

#: Set by ``tests/conftest.py`` before any test module is imported: ``--full`` was given.
FULL = False

#: Markers the quick loop leaves to the full run.
FULL_ONLY = ("slow", "full")

#: The smoke tier, marked ``smoke`` by ``tests/conftest.py``: the demo end to end through the console script,
#: one golden case against the reference's bytes, the layers and the map. A test id here that no longer
#: exists fails the tier (``test_the_smoke_tier_is_whole``).
SMOKE = (
    "tests/test_cli.py::test_demo_runs_and_an_identical_rerun_reuses_everything",
    "tests/test_golden.py::test_matches_reference[olmo_two_datasets-slices-of-3]",
    "tests/test_layers.py",
)


def examples(n: int) -> int:
    """Hypothesis examples for a property: ``n`` in the full run, a tenth of it (at least 5) in the loop,
    where they are the same each time (``derandomize``, set by ``tests/conftest.py``): the loop is for
    the edit at hand, the full run explores."""
    return n if FULL else max(5, n // 10)
