"""Byte-identity with the reference converter (outputs in tests/golden/expected, see PROVENANCE.md).

Each case runs through the real ``tokenize-mixer`` flow on a real Prefect API, with several slice sizes
and runners: the bytes must not depend on how the work was cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftmix.check.findings import check_output
from sftmix.config.run_options import RunOptions
from sftmix.output.digest import compare
from sftmix.tokenizing.engines import ENGINE_ENV, PROVEN_PATTERNS, fast_engine
from tests.tokenizer_fixtures import GOLDEN
from tokenize_mixer.cli import build_parser
from tokenize_mixer.command_line.convert_flags import mixer_from_convert_args
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

ALL_CASES = {c["name"]: c for c in json.loads((GOLDEN / "cases.json").read_text())["cases"]}
#: Cases the reference itself stops on: no bytes to match, and we must stop too (with our own message).
FAILING = {name: c for name, c in ALL_CASES.items() if "reference_fails" in c}
CASES = {name: c for name, c in ALL_CASES.items() if name not in FAILING}

VARIANTS = {
    "whole": {"slice_rows": 100_000, "runner": "thread"},
    "slices-of-3": {"slice_rows": 3, "runner": "thread"},
    "library-encoder": {"slice_rows": 3, "runner": "thread", "encoder": "hf"},
    "tiktoken-engine": {"slice_rows": 3, "runner": "thread", "engine": "tiktoken"},
}
PROCESS_VARIANT = {"slice_rows": 4, "runner": "process", "workers": 2}


def run_case(name: str, out: Path, work: Path, encoder: str = "auto", **options) -> dict:
    args = build_parser().parse_args(
        ["convert", *ALL_CASES[name]["args"], "--output_dir", str(out), "--encoder", encoder]
    )
    return tokenize_mixer(mixer=mixer_from_convert_args(args), run=RunOptions(work_dir=str(work), **options))


def encoders_used(work: Path) -> set[str]:
    """Which encoder made each slice, with the fast encoder's engine (from the manifests)."""
    manifests = [json.loads(p.read_text()) for p in work.glob("slices/*/*/manifest.json")]
    return {" ".join(filter(None, (m["encoder"], m.get("fast_engine")))) for m in manifests}


#: The one variant of each case the quick loop runs (many slices, the fast encoder); the others run in
#: the full suite (``--full``), the tiktoken engine's as slow.
QUICK_VARIANT, SLOW_VARIANTS = "slices-of-3", {"tiktoken-engine"}


#: The cases the quick loop runs: a cross-section (each tokenizer, dtype, format and template family,
#: truncation, two datasets, a fallback, tools); every case in the full suite.
QUICK_CASES = {
    "olmo_two_datasets",
    "olmo_truncated",
    "tiny_uint16_no_max",
    "tiny_olmo_parquet_splits",
    "zephyr_sharegpt",
    "olmo_thinker_think",
    "tools_own_template",
    "unknown_template_fallback",
}


def _variant(name: str) -> object:
    if name == QUICK_VARIANT:
        return name
    return pytest.param(name, marks=pytest.mark.slow if name in SLOW_VARIANTS else pytest.mark.full)


def _case(name: str) -> object:
    return name if name in QUICK_CASES else pytest.param(name, marks=pytest.mark.full)


@pytest.mark.parametrize("variant", [_variant(v) for v in sorted(VARIANTS)])
@pytest.mark.parametrize("case", [_case(c) for c in sorted(CASES)])
def test_matches_reference(case, variant, golden_dir, prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    options = dict(VARIANTS[variant])
    engine = options.pop("engine", "auto")
    monkeypatch.setenv(ENGINE_ENV, engine)
    report = run_case(case, tmp_path / "out", tmp_path / "work", **options)
    result = compare(tmp_path / "out", golden_dir / "expected" / case)
    assert result.matches, result.render()
    integrity = [f for f in check_output(tmp_path / "out").findings if f.kind == "integrity"]
    assert not integrity, integrity
    # computed here, not found in a cache (a dataset listed twice, as jsonl and parquet, computes once)
    assert report["slices_computed"] >= 1 and report["slices_reused"] < report["slices_total"]
    # both golden tokenizers (dolma2 and the tiny one) are proven: auto uses the fastest engine
    fast = "fast " + (engine if engine != "auto" else fast_engine(PROVEN_PATTERNS["cl100k"]))
    assert encoders_used(tmp_path / "work") == {"hf" if options.get("encoder") == "hf" else fast}


@pytest.mark.parametrize(
    "case", [c if c == "simple_chat" else pytest.param(c, marks=pytest.mark.full) for c in sorted(FAILING)]
)
def test_stops_where_the_reference_stops(case, golden_dir, prefect_api, tmp_path, monkeypatch):
    """Every row of a dataset fails the reference's span check: it raises "No examples left after
    transformation"; we fail the run naming the dataset and the reason, and publish nothing."""
    monkeypatch.chdir(golden_dir)
    assert (
        ALL_CASES[case]["reference_fails"]
        in (golden_dir / "reference_logs" / f"{case}.FAILED.log").read_text()
    )
    state = tokenize_mixer(
        mixer=mixer_from_convert_args(
            build_parser().parse_args(
                ["convert", *ALL_CASES[case]["args"], "--output_dir", str(tmp_path / "out")]
            )
        ),
        run=RunOptions(work_dir=str(tmp_path / "work"), slice_rows=100_000, runner="thread"),
        return_state=True,
    )
    assert state.is_failed()
    assert "no rows left after tokenization" in state.message and "assistant_span_unverified" in state.message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["olmo_truncated", "tulu_amounts", "no_filter_chain_sharegpt", "tools_own_template"]
)
def test_matches_reference_with_worker_processes(case, golden_dir, prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    report = run_case(case, tmp_path / "out", tmp_path / "work", **PROCESS_VARIANT)
    assert report["slices_total"] > 2
    result = compare(tmp_path / "out", golden_dir / "expected" / case)
    assert result.matches, result.render()


@pytest.mark.full  # (the loop has reuse in tests/test_flow.py)
def test_rerun_reuses_every_slice(golden_dir, prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    first = run_case("tulu_amounts", tmp_path / "a", tmp_path / "work", slice_rows=5, runner="thread")
    second = run_case("tulu_amounts", tmp_path / "b", tmp_path / "work", slice_rows=5, runner="thread")
    assert first["slices_computed"] == first["slices_total"] > 1
    assert second["slices_reused"] == second["slices_total"] and second["slices_computed"] == 0
    assert first["digests"] == second["digests"]
    assert compare(tmp_path / "b", golden_dir / "expected" / "tulu_amounts").matches


@pytest.mark.slow
def test_matches_reference_on_a_dask_local_cluster(golden_dir, prefect_api, tmp_path, monkeypatch):
    """runner=dask on a real distributed LocalCluster of 2 worker processes: the same bytes."""
    monkeypatch.chdir(golden_dir)
    report = run_case(
        "tulu_amounts", tmp_path / "out", tmp_path / "work", slice_rows=4, runner="dask", workers=2
    )
    assert report["slices_computed"] == report["slices_total"] > 2
    result = compare(tmp_path / "out", golden_dir / "expected" / "tulu_amounts")
    assert result.matches, result.render()
