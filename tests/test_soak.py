"""A few minutes of the randomized fault soak (tests/soak.py): every kind of stop, drawn at moments
nobody chose, against docs/stopping.md's stop table. The seed is printed first and in the failure, so that
`TOKENIZE_MIXER_SOAK_SEED=<seed> pytest tests/test_soak.py -s` (or bench/soak.py --seed) replays it."""

from __future__ import annotations

import pytest

from tests.soak import KINDS, default_seed, run_soak

pytestmark = pytest.mark.slow

#: Seconds of trials after the setup (data, database, baseline run; about 30 s). The local Prefect
#: stack starts inside this budget, at the first server-mode trial (about 30 s more): about 4 minutes.
TRIAL_SECONDS = 200.0


def test_every_drawn_fault_stops_the_run_as_the_stop_table_says():
    seed = default_seed()
    print(f"\nsoak seed {seed} (replay: TOKENIZE_MIXER_SOAK_SEED={seed})", flush=True)
    result = run_soak(seconds=TRIAL_SECONDS, seed=seed, kinds=KINDS, server=True)
    print(result.table())
    assert not result.aborted, f"seed {seed}: {result.aborted}"
    assert result.records, f"seed {seed}: no trial ran"
    assert result.ok, f"seed {seed}:\n{result.table()}\n\n{result.failures()}"
