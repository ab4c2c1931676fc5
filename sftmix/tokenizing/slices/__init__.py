"""One slice's checkpoint: tokens, label mask and per-row facts, with a manifest written last.

A slice is a range of source rows of one dataset (only the rows the mixer selects). Its directory,
named by the slice's content key, holds ``tokens.npy`` (kept rows back to back), ``mask.npy`` and
``rows.npy`` (one record per tokenized row); ``manifest.json`` lands last with the files' digests, so a
slice counts as done only when its manifest exists and every digest matches.

With a remote work directory (``gs://``) the files are written locally first (the machine's mirror),
then uploaded with the manifest object last; a machine that needs a slice it did not compute fetches
it and checks the digests before trusting it.

The package by concept: ``spec`` (what a slice is asked to do), ``manifest`` (what a finished one
holds), ``store`` (where it lives, read back and checked), ``encoding`` (the tokenizer and template
specs and what they build in a worker: its encoding, its renderer, the cached masker), ``executor`` (tokenizing one slice). Its names are importable from here.
"""

from sftmix.tokenizing.slices.encoding import (
    WorkerEncoding,
    WorkerTemplate,
    WorkerTokenizer,
    cached_masker,
    worker_encoding,
)
from sftmix.tokenizing.slices.executor import bad_row_error, rows_of, tokenize_slice
from sftmix.tokenizing.slices.manifest import (
    ALL_ZERO_SLICE_ROWS,
    ARTIFACTS,
    MANIFEST,
    OVER_LENGTH,
    OVER_LENGTH_DTYPE,
    PROGRESS,
    PROGRESS_SECONDS,
    ROW_DTYPE,
    SKELETONS,
    SLICE_FORMAT_VERSION,
    FileDigest,
    SliceManifest,
)
from sftmix.tokenizing.slices.spec import SliceOutput, SliceSpec, TokenizeContext
from sftmix.tokenizing.slices.store import (
    context_here,
    load_over_length,
    load_slice_arrays,
    load_slice_rows,
    note_progress,
    on_this_machine,
    push_slice,
    push_worker_tokenizer,
    read_manifest,
    read_progress,
    remote_slice_url,
    remote_tokenizer_url,
    save_npy,
    slice_dir,
    slice_here,
    unrecorded_over_length,
    verify_slice,
    verify_slices,
)

__all__ = [
    "SLICE_FORMAT_VERSION",
    "ROW_DTYPE",
    "ARTIFACTS",
    "OVER_LENGTH",
    "OVER_LENGTH_DTYPE",
    "MANIFEST",
    "PROGRESS",
    "PROGRESS_SECONDS",
    "SKELETONS",
    "ALL_ZERO_SLICE_ROWS",
    "FileDigest",
    "SliceManifest",
    "TokenizeContext",
    "SliceOutput",
    "WorkerTokenizer",
    "WorkerTemplate",
    "SliceSpec",
    "slice_dir",
    "remote_slice_url",
    "read_manifest",
    "verify_slice",
    "verify_slices",
    "push_slice",
    "load_slice_rows",
    "load_over_length",
    "unrecorded_over_length",
    "load_slice_arrays",
    "save_npy",
    "remote_tokenizer_url",
    "push_worker_tokenizer",
    "context_here",
    "on_this_machine",
    "slice_here",
    "note_progress",
    "read_progress",
    "WorkerEncoding",
    "worker_encoding",
    "cached_masker",
    "bad_row_error",
    "tokenize_slice",
    "rows_of",
]
