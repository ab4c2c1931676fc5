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


#: The modules that take longest in the full run (each minutes on 2 cores: ``--durations``), started first:
#: ``pytest -n`` hands each worker a module at a time (``--dist loadfile``), so a long one started last
#: leaves the other workers idle while it runs (``--no-loadscope-reorder``: xdist keeps this order rather than
#: its own, by tests a module). The rest follow in their order.
LONGEST_FIRST = (
    "tests/test_stopping.py",
    "tests/test_deployment.py",
    "tests/test_soak.py",
    "tests/test_work_pool.py",
    "tests/test_resources.py",
    "tests/test_runtime.py",
    "tests/test_kill.py",
    "tests/test_hub.py",
)


def started_first(path: str) -> int:
    """A module's place in the run: the longest first (:data:`LONGEST_FIRST`), then every other."""
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def examples(n: int) -> int:
    """Hypothesis examples for a property: ``n`` in the full run, a tenth of it (at least 5) in the loop,
    where they are the same each time (``derandomize``, set by ``tests/conftest.py``): the loop is for
    the edit at hand, the full run explores."""
    return n if FULL else max(5, n // 10)
