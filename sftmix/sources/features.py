"""The Arrow schema ``datasets`` casts a file's rows to: its features, derived from the file's own schema.

Both readers that bypass ``datasets``' whole-file conversion (:mod:`sftmix.sources.jsonl`, :mod:`sftmix.sources.parquet`)
cast their rows to it, so rows are the Python objects ``datasets`` gives. The result is kept in the
user's cache per schema and ``datasets`` version: importing ``datasets`` (0.5 s on 2 cores) is
otherwise the largest part of planning a small file.
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any


def features_schema(schema: Any) -> Any:
    """``datasets.Features.from_arrow_schema(schema).arrow_schema``, from the cache when known."""
    import pyarrow as pa

    from sftmix.runtime.storage import write_cache_file

    kept = _kept_schema_path(schema.serialize().to_pybytes())
    try:
        return pa.ipc.read_schema(pa.py_buffer(kept.read_bytes()))
    except (OSError, pa.ArrowException):
        pass
    import datasets

    found = datasets.Features.from_arrow_schema(schema).arrow_schema
    write_cache_file(kept, found.serialize().to_pybytes())  # (else converted again next time)
    return found


def schema_text(schema: Any) -> str:
    """An Arrow schema as the text layouts, slices and kept records carry (base64 of its IPC form)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


@lru_cache(maxsize=16)
def schema_of(text: str) -> Any:
    """The Arrow schema :func:`schema_text` wrote."""
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def _kept_schema_path(serialized: bytes) -> Path:
    from importlib.metadata import version

    from sftmix.config.run_options import cache_subdir

    key = hashlib.sha256(f"datasets {version('datasets')}\0".encode() + serialized).hexdigest()[:32]
    return cache_subdir("features-schemas") / f"{key}.arrow"


def decodes(schema: Any) -> bool:
    """Whether some feature of a schema written by ``datasets`` (its features in the schema's metadata)
    decodes its cells (an Image, an Audio): those rows are ``datasets``' own to read. A schema without
    that metadata has none."""
    if b"huggingface" not in (schema.metadata or {}):
        return False
    import datasets
    from datasets.features.features import require_decoding

    features = datasets.Features.from_arrow_schema(schema)
    return any(require_decoding(f) for f in features.values())
