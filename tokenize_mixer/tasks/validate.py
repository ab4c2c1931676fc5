"""Digest the output and compare it with a reference (directory or digests JSON)."""

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from sftmix.errors import ChecksumError
from sftmix.output.digest import compare, output_digests
from sftmix.output.report import Validation
from tokenize_mixer.tasks import fail_cleanly


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
@fail_cleanly
def validate_output(
    staging: Path, reference: str | None, digests: dict[str, str] | None = None
) -> tuple[dict[str, str], Validation | None]:
    """``digests``: the staging's, when the check computed them in its read of the output."""
    if digests is None:
        digests = output_digests(staging)
    if reference is None:
        return digests, None
    result = compare(staging, reference, digests)
    validation = Validation(reference=reference, matches=result.matches, details=result.render())
    if not result.matches:
        raise ChecksumError(f"output differs from reference {reference}:\n{result.render()}")
    return digests, validation
