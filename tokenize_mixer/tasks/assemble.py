"""Assemble the shards from the slice checkpoints into a staging directory."""

from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from sftmix.assembly.assemble import AssembleResult, assemble
from sftmix.check.findings import CheckReport
from sftmix.planning.plan import Plan
from sftmix.tokenizing.slices import SliceManifest
from tokenize_mixer.tasks import fail_cleanly


@task(name="assemble", cache_policy=NO_CACHE, persist_result=False)
@fail_cleanly
def assemble_output(
    plan: Plan,
    manifests: list[SliceManifest],
    staging: Path,
    documents: Path,
    check: Callable[..., CheckReport] | None = None,
) -> AssembleResult:
    """``check``: ``check_output`` of the staging but for ``written``, made while the parts are written."""
    return assemble(plan, manifests, staging, documents, check)
