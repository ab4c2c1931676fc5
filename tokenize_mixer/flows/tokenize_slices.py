"""The ``tokenize-slices`` flow: one batch of a ``tokenize-mixer`` run's slices, on whichever machine's
Prefect worker picks it up (``run.runner: work_pool``). Each slice is still a ``tokenize_slice`` task
run with its result persisted in the remote work directory, where the parent run reads it."""

from __future__ import annotations

import functools
import os

from prefect import flow
from prefect.states import Cancelled, Failed, State

from sftmix.config.run_options import RunOptions
from sftmix.errors import MixerError
from sftmix.planning.roots import check_slices_allowed
from sftmix.runtime.stopping import EXIT_CANCELLED, RunStopped, follow_supervisor
from sftmix.tokenizing.slices import SliceSpec, TokenizeContext, context_here, slice_here
from tokenize_mixer.flows.api.watch import report_crashed
from tokenize_mixer.flows.fanout import run_slice_specs
from tokenize_mixer.flows.workers.worker_start import fork_workers_from_server


@flow(name="tokenize-slices", validate_parameters=True)
def tokenize_slices(
    slices: list[SliceSpec], ctx: TokenizeContext, workers: int = 0, reuse: bool = True
) -> dict | State:
    """Tokenize ``slices`` on this machine's cores (``workers``: 0 for all of them) into the remote work
    directory of ``ctx``; ``reuse``: a slice already finished there is not computed again."""
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run_id:
        follow_supervisor(
            "the Prefect worker that started this flow run",
            before_exit=functools.partial(report_crashed, flow_run_id),
        )
        fork_workers_from_server()  # one flow run a process: its workers forked ready (flows.workers.worker_start)
    try:
        check_slices_allowed(
            [s.dataset for s in slices], ctx.tokenizer.name_or_path, ctx.output.remote_work_dir
        )
        here = context_here(ctx)
        if here is not ctx:  # (the planner's files are not all on this machine)
            slices = [slice_here(s) for s in slices]
        outcome = run_slice_specs(slices, here, RunOptions(workers=workers or None, force_recache=not reuse))
        return {"slices": len(slices), "computed": outcome.computed, "reused": outcome.reused}
    except MixerError as exc:
        return Failed(message=str(exc), data=exc)
    except RunStopped as exc:
        if exc.exit_code == EXIT_CANCELLED:
            return Cancelled(message=f"{exc.reason}; finished slices are checkpointed")
        raise
