"""Plan the mixer (opens every dataset's metadata; no tokenizing)."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from sftmix.config import MixerConfig, RunOptions
from sftmix.plan import Plan, build_plan
from tokenize_mixer.tasks import fail_cleanly


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
@fail_cleanly
def plan_mixer(mixer: MixerConfig, run: RunOptions) -> Plan:
    return build_plan(mixer, run)
