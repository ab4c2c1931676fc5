"""What a tokenizing worker imports before its first slice, imported once by the server that the
command's workers are forked from (``flows.worker_start``), so that each worker starts with it
instead of importing it again.

transformers comes through ``import_transformers``: imported plainly it would import PyTorch where that
is installed (8.6 s on the lent 16-core machine), which tokenizing never needs. Also imported: what the
command's module imports, since each worker runs that module again as its main module (not
``sftmix.cli`` itself: runpy warns when ``python -m sftmix.cli`` finds it imported already)."""

from sftmix.tokenizer import import_transformers

import_transformers()

import datasets  # noqa: E402, F401
import prefect.task_engine  # noqa: E402, F401
import prefect.task_runners  # noqa: E402, F401

import sftmix.config  # noqa: E402, F401
import sftmix.reference_flags  # noqa: E402, F401
import sftmix.report  # noqa: E402, F401
import sftmix.selection  # noqa: E402, F401
import tasks.tokenize  # noqa: E402, F401
