"""Whether a published output already holds what this run would publish: then the run is a no-op.

A local output's marker (:mod:`sftmix.runtime.ownership`) records what its bytes follow from and what it is:

- ``recipe``: the plan's recipe (the mixer, the data's and the tokenizer's content fingerprints, the
  template's hash, the dtype);
- ``inputs``: the run's settings with the versions of the packages that compute bytes, and the stamp
  (size, mtime, inode) of every local file the recipe was computed from (data files, the tokenizer
  directory's files, the template file), taken *before* the plan read them;
- ``stamps``: the size and mtime of every file the publish wrote.

A rerun is up to date when the output is intact (every file it published is there with the size and
mtime it was published with: a rename keeps both, an edit changes them) and its inputs are the same,
known one of two ways: before any plan, when this run's ``inputs`` equal the recorded ones (no file is
read: seconds at any size); or after a plan, when its recipe equals the recorded one (hub datasets, or a
file touched but not changed). The second way also records the new stamps, so the next rerun is quick.
``force`` (and ``force_recache``, ``disable_cache``) always does the work. What the check does not
prove: a file whose bytes changed while its size and mtime stayed (bit rot, a tool that restores
mtimes); ``tokenize-mixer compare`` against digests, or ``--force``, covers that.

Only local outputs: a ``gs://`` output has no marker (its manifest object is its proof of completeness),
and runs into one always publish, uploading only the objects that changed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sftmix.check.findings import CHANGES_TRAINING, INFORMATION
from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.errors import ChecksumError
from sftmix.output.digest import RUN_REPORT, compare, load_digests
from sftmix.output.output_dir import OUTPUT_MARKER, changed_since_published, read_output_marker
from sftmix.output.publish import update_output_marker
from sftmix.output.report import UP_TO_DATE, RunReport, Validation
from sftmix.planning.recipe import input_record
from sftmix.runtime.storage import is_remote

logger = logging.getLogger(__name__)


class UpToDate(Exception):
    """Raised by a command that found the output up to date while it started (its plan made beside the
    Prefect API's start): the command ends there, with this report, and no flow run."""

    def __init__(self, report: RunReport) -> None:
        super().__init__("the output is up to date")
        self.report = report


_said: set[tuple[str, str]] = set()


def _making_again(output: str, why: str) -> None:
    """Say once per process (the command and its flow look more than once) why the work is done."""
    if (output, why) not in _said:
        _said.add((output, why))
        logger.info("the output's recipe is this run's, but %s: making it again", why)


def _published_report(directory: Path) -> RunReport | None:
    try:
        return RunReport.model_validate_json((directory / RUN_REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _run_wants_more(mixer: MixerConfig, run: RunOptions, report: RunReport) -> str | None:
    """Why this run must do the work although the output's bytes would be the same: it asks for a check
    the published output did not pass, or fails on bad rows the published one skipped."""
    if run.check != "off" and mixer.output.format == "olmo" and report.findings.check_findings is None:
        return "the output was published without the check this run asks for"
    if run.check == "strict" and any(
        f.get("severity", CHANGES_TRAINING) != INFORMATION for f in report.findings.check_findings or []
    ):
        return "the output has check findings and this run's check is strict"
    if mixer.on_bad_row == "error" and report.rows.rows_dropped.get("bad_row"):
        return "the output skipped malformed rows and this run fails on them (on_bad_row: error)"
    return None


def _candidate_marker(mixer: MixerConfig, run: RunOptions) -> dict | None:
    """The marker of a published output this run may find up to date (one with a recipe, local, no
    ``force``); ``None`` when the run has work to do whatever its plan says."""
    output = mixer.output.path
    if run.force or run.force_recache or run.disable_cache or is_remote(output) or not os.path.isdir(output):
        return None
    marker = read_output_marker(Path(output))
    if marker is None or not isinstance(marker.get("recipe"), dict):
        return None
    return marker


def may_be_up_to_date(mixer: MixerConfig, run: RunOptions) -> bool:
    """Whether only the plan can tell that this run has nothing to do (its output is published, its
    inputs' stamps changed): the command then plans before it starts a Prefect API."""
    return _candidate_marker(mixer, run) is not None


def up_to_date(mixer: MixerConfig, run: RunOptions, recipe: dict | None = None) -> RunReport | None:
    """The published output's report, marked up to date, when this run would publish the same bytes
    into an intact output; ``None`` when the run must do its work. Without ``recipe`` only the quick
    way (recorded input stamps) is tried; with it, the recipe decides. A ``run.reference`` is compared
    with the digests the output was published with: a difference fails as validation does."""
    marker = _candidate_marker(mixer, run)
    if marker is None:
        return None
    output = mixer.output.path
    directory = Path(output)
    if recipe is not None:
        same = marker["recipe"] == recipe
    else:
        recorded = marker.get("inputs")
        same = isinstance(recorded, dict) and recorded == input_record(mixer)
    if not same:
        return None
    if (why := changed_since_published(directory, marker)) is not None:
        _making_again(output, why)
        return None
    report = _published_report(directory)
    if report is None:
        return None
    if (why := _run_wants_more(mixer, run, report)) is not None:
        _making_again(output, why)
        return None
    validation = None
    if run.reference is not None:
        expected, _ = load_digests(run.reference)
        matches = expected == report.output.digests
        details = (
            "the output's digests (as published) match"
            if matches
            else compare(output, run.reference).render()
        )
        validation = Validation(reference=run.reference, matches=matches, details=details)
        if not matches:
            raise ChecksumError(f"output differs from reference {run.reference}:\n{details}")
    return _found_up_to_date(report, marker.get("published_at"), validation)


def _found_up_to_date(
    report: RunReport, published_at: str | None, validation: Validation | None
) -> RunReport:
    """The published report as this run's: nothing computed, reused or timed by it (the run that made the
    output keeps its other times and counts)."""
    slices = report.slices.model_copy(
        update={"slices_computed": 0, "slices_reused": 0, "slices_rechecked": 0}
    )
    timings = report.timings.model_copy(
        update={
            "plan_seconds": 0.0,
            "tokenize_seconds": 0.0,
            "tokens_per_second": 0.0,
            "steady_seconds": 0.0,
            "steady_tokens_per_second": 0.0,
            "wall_seconds": 0.0,
            "command_seconds": None,
        }
    )
    return report.model_copy(
        update={
            "publish": UP_TO_DATE,
            "published_at": published_at,
            "slices": slices,
            "timings": timings,
            "validation": validation,
        }
    )


def remember_inputs(output: str, recipe: dict, inputs: dict | None) -> None:
    """After a plan found the output up to date by its recipe: record this run's input stamps in the
    marker (only if it still holds that recipe), so the next rerun needs no plan."""
    if inputs is None or is_remote(output):
        return

    def update(marker: dict) -> bool:
        if marker.get("recipe") != recipe or marker.get("inputs") == inputs:
            return False
        marker["inputs"] = inputs
        return True

    try:
        update_output_marker(Path(output), update)
    except OSError as exc:  # a view of the inputs, never a reason to fail a run that did nothing
        logger.info("could not record the inputs' stamps in %s: %s", Path(output) / OUTPUT_MARKER, exc)
