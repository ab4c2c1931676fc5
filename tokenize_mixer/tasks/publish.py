"""Publish the staging directory as the output directory."""

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from sftmix.output.publish import UNCHECKED, publish
from tokenize_mixer.tasks import fail_cleanly


@task(name="publish", cache_policy=NO_CACHE, persist_result=False)
@fail_cleanly
def publish_output(
    staging: Path,
    output: str,
    overwrite: bool,
    seen_id: str | None = UNCHECKED,
    recipe: dict | None = None,
    inputs: dict | None = None,
) -> str:
    return publish(staging, output, overwrite, seen_id, recipe, inputs)
