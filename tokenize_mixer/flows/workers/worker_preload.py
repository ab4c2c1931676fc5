"""What a tokenizing worker imports before and during its first slice, imported once by the server that
the command's workers are forked from (``flows.workers.worker_start``), so that each worker starts with it
instead of importing it again.

Only what a worker of the command imports, taken from the modules a spawned worker holds after its
slices: Prefect's task engine, the installed Prefect collections (Prefect imports every one of them
when a worker rebuilds the task's result storage: with prefect-dask that is all of Dask, 0.4 s), the
tokenizers library, pyarrow, and the flow's modules (the task's functions are pickled from them).
Not transformers or datasets (the command imports them only for a tokenizer or a file it has not
seen before: :mod:`sftmix.tokenizing.tokenizer_facts`): a worker reads the plan's Arrow files and the plan's
tokenizer file, and importing the two cost the server 1.2-1.5 s of CPU, competing with the API's start
on a small machine. ``flows.workers.worker_start`` adds datasets for a mixer that names a
dataset the plan may not convert. Also imported: what the command's module imports, since each worker
runs that module again as its main module (not ``tokenize_mixer.cli`` itself: runpy warns when
``python -m tokenize_mixer.cli`` finds it imported already)."""

import gc

import prefect.task_engine  # noqa: F401
import prefect.task_runners  # noqa: F401
import pyarrow  # noqa: F401
import tokenizers  # noqa: F401
from prefect.plugins import load_prefect_collections

import sftmix.config.config  # noqa: F401
import sftmix.config.reference_flags  # noqa: F401
import sftmix.config.selection  # noqa: F401
import sftmix.output.report  # noqa: F401
import tokenize_mixer.flows.tokenize_mixer  # noqa: F401
import tokenize_mixer.flows.workers.pool  # noqa: F401
import tokenize_mixer.tasks.tokenize  # noqa: F401

load_prefect_collections()

# What the server imported lives as long as each worker forked from it: moved out of the collector's
# reach, so that a worker's full collections walk only its own objects (with the imports in reach, each
# took ~0.1 s, about once per 6,000 ShareGPT rows: 4x ShareGPT tokenized 6% faster without them,
# bench/results/history.md, session 49), and the collector does not write to the pages workers share with it.
gc.freeze()
