"""What is in an output directory, and whether a run may replace it: the marker that says what we
published there (and from what recipe), the entries we did not write, the paths an output must never
be, and the refusals a run makes of an output before any work (another recipe, other settings).

Replacing it is ``sftmix.output.publish``'s; whether it already holds this run's shards, ``sftmix.assembly.up_to_date``'s.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions, default_work_dir, local_mirror
from sftmix.errors import ConfigError, OutputConflictError
from sftmix.runtime.ownership import LEASE_MARKER
from sftmix.runtime.storage import TMP_MARK, atomic_write_bytes, is_remote, remote_fs, storage_errors

OUTPUT_MARKER = ".tokenize-mixer-output.json"
OUTPUT_MARKER_FORMAT = "tokenize-mixer-output-marker/1"


def _relative_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())


def utc_stamp() -> str:
    """Now, as the output's records write a time: ``2026-11-29T09:40:41Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_output_marker(
    staging: Path, recipe: dict | None = None, inputs: dict | None = None, published_at: str | None = None
) -> str:
    """Mark ``staging`` (about to be published, every file in place) as our output; returns the publish
    id. ``recipe``: what its bytes follow from (``Plan.recipe``), for the next run into it to compare
    before any work; ``inputs``: the stamps of the files it was computed from
    (:func:`sftmix.assembly.up_to_date.input_record`). The size and mtime of every file are recorded too, so a
    rerun can tell the output is still as published (a rename keeps both)."""
    ident = uuid.uuid4().hex
    files = [f for f in _relative_files(staging) if f not in (OUTPUT_MARKER, LEASE_MARKER)]
    marker = {
        "format": OUTPUT_MARKER_FORMAT,
        "id": ident,
        "published_at": published_at or utc_stamp(),
        "files": files,
        "stamps": {f: [(st := (staging / f).stat()).st_size, st.st_mtime_ns] for f in files},
        **({} if recipe is None else {"recipe": recipe}),
        **({} if inputs is None else {"inputs": inputs}),
    }
    write_marker(staging, marker)
    return ident


def write_marker(directory: Path, marker: dict) -> None:
    """The output marker of ``directory``, written whole (atomically)."""
    atomic_write_bytes(directory / OUTPUT_MARKER, json.dumps(marker, indent=1).encode("utf-8"))


def changed_since_published(directory: Path, marker: dict) -> str | None:
    """Why the output in ``directory`` is not as it was published (``None``: every file it published is
    there with the size and mtime it had then)."""
    stamps = marker.get("stamps")
    if not isinstance(stamps, dict) or not stamps:
        return "its marker records no file stamps (published by an older version)"
    for name, recorded in stamps.items():
        try:
            st = os.stat(directory / name)
        except OSError:
            return f"{name} is missing"
        if [st.st_size, st.st_mtime_ns] != recorded:
            return f"{name} changed since it was published"
    return None


def read_output_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / OUTPUT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != OUTPUT_MARKER_FORMAT:
        return None
    return marker if isinstance(marker.get("files"), list) else None


def record_output_files(directory: Path, names: Iterable[str]) -> None:
    """Add files we wrote into an existing output (e.g. the report) to its marker."""
    marker = read_output_marker(directory)
    if marker is None:
        return
    marker["files"] = sorted(set(marker["files"]) | set(names))
    write_marker(directory, marker)


def output_id(directory: Path) -> str | None:
    """The publish id of the output in ``directory`` (None: absent, empty, or not ours)."""
    marker = read_output_marker(directory)
    return None if marker is None else str(marker.get("id"))


def foreign_entries(directory: Path) -> list[str]:
    """Entries of ``directory`` that tokenize-mixer did not write (all of them without our marker)."""
    marker = read_output_marker(directory)
    present = _relative_files(directory)
    if marker is None:
        return present or sorted(p.name + "/" for p in directory.iterdir())
    ours = set(marker["files"]) | {OUTPUT_MARKER, LEASE_MARKER}
    return [f for f in present if f not in ours]


def check_replaceable(directory: Path) -> None:
    """Refuse to replace a non-empty directory that is not wholly a tokenize-mixer output."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return
    foreign = foreign_entries(directory)
    if not foreign:
        return
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    if read_output_marker(directory) is None:
        why = f"it is not a tokenize-mixer output (no {OUTPUT_MARKER}; it holds {shown})"
    else:
        why = f"it holds files tokenize-mixer did not write there: {shown}"
    raise OutputConflictError(
        f"output directory {directory} will not be replaced: {why}. Choose a new or empty directory, "
        "or move those files away yourself."
    )


def _ancestor_or_same(a: Path, b: Path) -> bool:
    return a == b or a in b.parents


def refuse_dangerous_output(output: str | Path, protected: Iterable[tuple[str, str | Path]]) -> None:
    """Refuse an output that is ``/``, ``$HOME``, the work directory, an input, or an ancestor of one.

    ``protected`` names each path that must survive the run (what it is, where it is)."""
    out = Path(os.path.realpath(Path(output).expanduser()))
    everything = [("the file system root", Path("/")), ("your home directory", Path.home())]
    everything += [(what, Path(where)) for what, where in protected]
    for what, where in everything:
        resolved = Path(os.path.realpath(Path(where).expanduser()))
        if _ancestor_or_same(out, resolved):
            relation = "is" if out == resolved else "contains"
            raise ConfigError(
                f"output {output} {relation} {what} ({resolved}): publishing replaces the whole output "
                f"directory, so it must be a directory of its own, e.g. {out / 'shards'}"
            )


# ---- before any work: may this run's output go there ---------------------------------------------


def paths_to_protect(mixer: MixerConfig, run: RunOptions) -> list[tuple[str, str | Path]]:
    """Local paths the output must never be, nor contain: the work directory, the current directory,
    and every local input (datasets, tokenizer, template file, reference)."""
    work = local_mirror(run.work_dir) if is_remote(run.work_dir) else (run.work_dir or default_work_dir())
    paths: list[tuple[str, str | Path]] = [
        ("the work directory", work),
        ("the current directory", Path.cwd()),
    ]
    candidates = [(f"the input dataset {d.path}", d.path) for d in mixer.datasets]
    candidates += [
        ("the tokenizer", mixer.tokenizer.name_or_path),
        ("the chat template file", mixer.tokenizer.chat_template or ""),
        ("the reference", run.reference or ""),
    ]
    paths += [
        (what, where) for what, where in candidates if where and not is_remote(where) and _exists(where)
    ]
    return paths


def _exists(path: str) -> bool:
    try:
        return Path(path).expanduser().exists()
    except OSError:
        return False


def check_output_free(output: str | Path, protected: Iterable[tuple[str, str | Path]] = ()) -> str | None:
    """Fail early (before any work) when the output cannot become this run's directory; returns the
    publish id of the output there now (None when there is none), which publishing checks again."""
    if is_remote(output):
        url = str(output)
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        try:
            reachable = remote_fs(url).exists(url.split("://", 1)[0] + "://" + bucket)
        except Exception as exc:
            raise ConfigError(f"output {url}: cannot reach the bucket: {type(exc).__name__}: {exc}") from None
        if not reachable:
            raise ConfigError(f"output {url}: bucket {bucket!r} does not exist")
        return None
    refuse_dangerous_output(output, protected)
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory")
    if out.is_dir():
        check_replaceable(out)
    with storage_errors(f"output {out} is not writable"):  # probe now, not after hours of work
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}{TMP_MARK}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    return output_id(out) if out.is_dir() else None


def refuse_different_output(output: str, overwrite: bool, recipe: dict) -> None:
    """Before any work: an output we published from another recipe would hold different shards, which
    publishing refuses without ``overwrite``; say so now, with what changed, not after hours of work.
    (An output with no recipe, from an older version, is compared when publishing, as before.)"""
    if overwrite or is_remote(output) or not Path(output).is_dir():
        return
    marker = read_output_marker(Path(output))
    before = None if marker is None else marker.get("recipe")
    if not isinstance(before, dict) or before == recipe or _data_kinds(before) != _data_kinds(recipe):
        return  # (data fingerprinted another way, by an older version: publishing compares the digests)
    raise _conflict(output, recipe_changes(before, recipe))


def refuse_different_settings(output: str, overwrite: bool, mixer: dict, recipe_format: str) -> None:
    """:func:`refuse_different_output` from the settings alone (``mixer``: the recipe's ``mixer`` part,
    made from the config), before a Prefect API starts or the tokenizer loads: the command says it in
    under a second. An output whose recipe is of another format is left to the plan's check."""
    if overwrite or is_remote(output) or not Path(output).is_dir():
        return
    marker = read_output_marker(Path(output))
    before = None if marker is None else marker.get("recipe")
    if not isinstance(before, dict) or before.get("format") != recipe_format or before.get("mixer") == mixer:
        return
    raise _conflict(output, recipe_changes(before.get("mixer"), mixer, "mixer"))


def _conflict(output: str, changes: list[str]) -> OutputConflictError:
    return OutputConflictError(
        f"output directory {output} holds shards made with other settings or data ("
        + "; ".join(changes[:3])
        + (f"; {len(changes) - 3} more" if len(changes) > 3 else "")
        + "): this run would replace them; choose another directory, or set overwrite (--overwrite, or "
        "'Replace different shards' under Output in the UI) to replace them. Nothing was tokenized."
    )


def _data_kinds(recipe: dict) -> list[str]:
    """How each dataset's content was fingerprinted ('sha256', 'jsonl-batches', 'hf')."""
    data = recipe.get("data")
    return [str(d).split(":", 1)[0] if ":" in str(d) else "" for d in data] if isinstance(data, list) else []


def recipe_changes(before: Any, after: Any, where: str = "") -> list[str]:
    """What differs between two recipes, as ``mixer.datasets[1].amount: 100 -> 50`` lines."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [
            change
            for key in sorted(set(before) | set(after), key=str)
            for change in recipe_changes(
                before.get(key), after.get(key), f"{where}.{key}" if where else str(key)
            )
        ]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [
            c
            for i, (a, b) in enumerate(zip(before, after, strict=True))
            for c in recipe_changes(a, b, f"{where}[{i}]")
        ]
    if before == after:
        return []
    if where.startswith("data["):
        return [f"the data of dataset {where[5:-1]} changed"]
    if isinstance(before, list) and isinstance(after, list):
        return [f"{where}: {len(before)} -> {len(after)} entries"]
    if where in ("tokenizer", "template"):
        return [f"the {where}'s content changed"]
    return [f"{where}: {_short(before)} -> {_short(after)}"]


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
