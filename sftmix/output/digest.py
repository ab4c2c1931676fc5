"""Digest an output and compare two (sha256 of each artifact, as run_report.json lists them).

Token and label parts hash as bytes, ``.csv.gz`` after decompression (gzip headers hold a timestamp),
``dataset_statistics.json`` without ``timestamp``/``output_directory`` dumped with sorted keys. The
human report, ``tokenizer/``, ``run_report.json`` and temporary files are skipped. On a mismatch the
first differing byte is mapped to its part offset, document, and (when the run left its document map)
dataset and row.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sftmix.errors import ConfigError
from sftmix.output.content import (
    Layout,
    differing_streams,
    document_map_source,
    documents_line,
    first_difference,
    parts_text,
)
from sftmix.output.olmo_format import BOUNDS_PART, RUN_REPORT, STATS_JSON, STATS_TXT
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import (
    is_remote,
    is_temp,
    join_url,
    read_remote_bytes,
    remote_fs,
    sha256_stream,
)

DIGESTS_FORMAT = "tokenize-mixer-digests/1"
#: Written last when publishing to an object store: the output is complete exactly when it exists.
OUTPUT_MANIFEST = "tokenize_mixer_manifest.json"
SKIPPED = {STATS_TXT, RUN_REPORT, OUTPUT_MANIFEST, "tokenizer", "report.png", "report.md"}


def artifact_digest(path: Path) -> str:
    return stream_digest(path.name, lambda: open(path, "rb"))


def stream_digest(name: str, open_binary: Callable[[], BinaryIO]) -> str:
    """The digest of one artifact, read once from whatever ``open_binary`` opens."""
    with open_binary() as raw:
        if name == STATS_JSON:
            stats = json.loads(raw.read().decode("utf-8"))
            stats.pop("timestamp", None)
            stats.pop("output_directory", None)
            return hashlib.sha256(json.dumps(stats, sort_keys=True).encode("utf-8")).hexdigest()
        if name.endswith(".gz"):
            try:
                with gzip.open(raw, "rb") as fh:
                    return sha256_stream(fh)
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:  # damaged: differs from any digest
                return f"unreadable gzip ({type(exc).__name__}: {exc})"
        return sha256_stream(raw)


def counts_in_digests(name: str) -> bool:
    return name not in SKIPPED and not is_temp(name) and not name.startswith(".")


def is_shard(name: str) -> bool:
    """Whether an output-relative path is part of the digests (reports and the tokenizer copy are not)."""
    return counts_in_digests(name.rsplit("/", 1)[-1]) and ("/" not in name or name.startswith("data/"))


def digested_files(directory: str | Path) -> list[Path]:
    """The files of an output that its digests cover, in the digests' order."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    files = [p for p in sorted(root.iterdir()) if counts_in_digests(p.name) and p.is_file()]
    data = root / "data"  # the hf_parquet layout keeps its shards one level down
    if data.is_dir():
        files += [p for p in sorted(data.iterdir()) if counts_in_digests(p.name) and p.is_file()]
    return files


def output_digests(directory: str | Path) -> dict[str, str]:
    root = Path(directory)
    files = digested_files(root)
    return dict(
        zip((p.relative_to(root).as_posix() for p in files), in_parallel(artifact_digest, files), strict=True)
    )


def in_parallel(fn: Callable[[Path], str], paths: list[Path]) -> list[str]:
    """``fn`` over files on threads, results in order: hashing and gzip release the GIL, so an output of
    many parts is read on every core instead of one (each file is still read in bounded chunks)."""
    if len(paths) <= 1:
        return [fn(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), available_cpus())) as pool:
        return list(pool.map(fn, paths))


def read_output_manifest(url: str) -> dict | None:
    """The manifest object of a published remote output, or ``None`` (absent or unreadable)."""
    data = read_remote_bytes(join_url(url, OUTPUT_MANIFEST))
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def remote_output_digests(url: str) -> dict[str, str]:
    """Digests of a published remote output, read from its objects; only a complete output (its
    manifest object present, every listed object there) is digested."""
    manifest = read_output_manifest(url)
    if manifest is None:
        raise ConfigError(
            f"{url} holds no complete output: no {OUTPUT_MANIFEST} (nothing published there, or a publish "
            "is under way or was interrupted)"
        )
    fs = remote_fs(url)
    digests = {}
    for name in sorted(manifest["files"]):
        if not is_shard(name):
            continue
        try:
            digests[name] = stream_digest(name, lambda n=name: fs.open(join_url(url, n), "rb"))  # type: ignore[misc]  # a lambda with a default: mypy cannot type it
        except FileNotFoundError:
            raise ConfigError(f"{url}: {name} is listed in {OUTPUT_MANIFEST} but missing") from None
    return digests


def digests_json(directory: str | Path) -> str:
    """The digests of an output as the JSON that ``compare`` and ``--reference`` accept."""
    files = remote_output_digests(str(directory)) if is_remote(directory) else output_digests(directory)
    return json.dumps({"format": DIGESTS_FORMAT, "files": files}, indent=2, sort_keys=True) + "\n"


def load_digests(source: str | Path) -> tuple[dict[str, str], Path | None]:
    """Digests of a directory, or of a digests JSON; also the directory when there is one."""
    if is_remote(source):
        return remote_output_digests(str(source)), None
    p = Path(source)
    if p.is_dir():
        return output_digests(p), p
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p} is neither an output directory nor a digests JSON: {exc}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise ConfigError(f"{p} is not a digests JSON (no 'files' mapping)")
    return files, None


@dataclass
class Difference:
    name: str
    status: str  # OK, DIFF, ONLY_A, ONLY_B
    detail: str = ""


#: What an output's files hold, as a comparison's verdict names them (the first whose test a name passes).
KINDS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("tokens", lambda name: name.startswith("token_ids_part_") and name.endswith(".npy")),
    ("masks", lambda name: name.startswith("labels_mask_part_")),
    ("boundaries", lambda name: name.endswith(".csv.gz")),
    ("statistics", lambda name: name.startswith("dataset_statistics")),
)
#: What a trainer reads of an OLMo-core output.
TRAINED = ("tokens", "masks", "boundaries")


def kind_of(name: str) -> str:
    return next((kind for kind, holds in KINDS if holds(name)), "other files")


def _words(kinds: list[str]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]


@dataclass
class Comparison:
    items: list[Difference] = field(default_factory=list)
    parts: str | None = None  # where the outputs' parts end elsewhere: how many each has
    streams: list[str] = field(default_factory=list)  # then, which of tokens, masks, documents differ
    documents: str | None = None  # where their contents first differ, by document in each

    @property
    def matches(self) -> bool:
        return all(i.status == "OK" for i in self.items)

    def verdict(self) -> str:
        """Which kinds of file differ, and which of what a trainer reads are identical: two outputs that
        differ only in a dataset's name in the statistics read as that."""
        kinds = [*(kind for kind, _ in KINDS), "other files"]
        differ = [k for k in kinds if any(kind_of(i.name) == k and i.status != "OK" for i in self.items)]
        if not differ:
            return "outputs match"
        if self.parts is not None:  # read across parts: what a trainer reads, whatever the layout
            rest = [k for k in differ if k not in TRAINED]
            same = [k for k in ("documents", "tokens", "masks") if k not in self.streams]
            if not self.streams:
                head = f"same {_words(same)}; part layout differs: {self.parts}"
            else:
                head = f"outputs DIFFER in {_words(self.streams)}" + (
                    f" ({_words(same)} the same)" if same else ""
                )
                head += f" and in part layout: {self.parts}"
            return head + (f"; {_words(rest)} differ" if rest else "")
        present = {kind_of(i.name) for i in self.items}
        same = [k for k in TRAINED if k in present and k not in differ]
        return f"outputs DIFFER in {_words(differ)}" + (f"; {_words(same)} are identical" if same else "")

    def render(self) -> str:
        shown = [i for i in self.items if self.parts is None or kind_of(i.name) not in TRAINED]
        lines = [f"{i.status:<6} {i.name}" + (f"  {i.detail}" if i.detail else "") for i in shown]
        if self.parts is not None:
            lines.append(f"PARTS  {self.parts}: the parts end elsewhere, so they are compared across parts")
        if self.documents is not None:
            lines.append(self.documents)
        lines.append(self.verdict())
        return "\n".join(lines)


def _part_index(name: str) -> int | None:
    stem = name.rsplit("_part_", 1)
    if len(stem) != 2:
        return None
    try:
        return int(stem[1].split(".")[0])
    except ValueError:
        return None


def locate(directory: Path, part: int, token: int) -> str:
    """Which document (and, when the run left its document map, dataset and row) holds a token."""
    g = token + sum(
        (directory / f"labels_mask_part_{k:04d}.npy").stat().st_size
        for k in range(part)
        if (directory / f"labels_mask_part_{k:04d}.npy").exists()
    )
    where = f"token {token} of part {part} (global token {g})"
    mapped = _dataset_row(directory, g)
    if mapped:
        return where + mapped
    bounds = directory / BOUNDS_PART.format(part)
    if bounds.exists():
        with gzip.open(bounds, "rt") as fh:
            for j, line in enumerate(fh):
                start, end = (int(x) for x in line.split(","))
                if start <= token < end:
                    return where + f", document {j} of the part (tokens {start}-{end})"
    return where


def _dataset_row(directory: Path, global_token: int) -> str:
    mapped = document_map_source(directory, global_token)
    return "" if mapped is None else f", {mapped.place}"


def compare(a: str | Path, b: str | Path, digests_a: dict[str, str] | None = None) -> Comparison:
    """``digests_a``: the digests of directory ``a``, when they are known already."""
    da, dir_a = (digests_a, Path(a)) if digests_a is not None else load_digests(a)
    db, dir_b = load_digests(b)
    result = Comparison()
    for name in sorted(set(da) | set(db)):
        if name not in db:
            result.items.append(Difference(name, "ONLY_A"))
        elif name not in da:
            result.items.append(Difference(name, "ONLY_B"))
        else:
            result.items.append(Difference(name, "OK" if da[name] == db[name] else "DIFF"))
    la = None if dir_a is None else Layout.of(dir_a)
    lb = None if dir_b is None else Layout.of(dir_b)
    trained = any(i.status != "OK" and kind_of(i.name) in TRAINED for i in result.items)
    if la is not None and lb is not None and trained and _across_parts(result, la, lb):
        return result  # (a byte offset in a part means nothing where the parts begin elsewhere)
    for item in result.items:
        if item.status == "DIFF":
            item.detail = _explain(item.name, dir_a, dir_b)
    return result


def _across_parts(result: Comparison, a: Layout, b: Layout) -> bool:
    """``result`` with what the outputs' contents say, read across their parts; whether their parts begin
    elsewhere. A file that cannot be read so (damaged) leaves the comparison to the files."""
    try:
        if a.firsts[:-1] == b.firsts[:-1]:
            result.documents = documents_line(a, b)
            return False
        result.parts, result.streams = parts_text(a, b), differing_streams(a, b)
        if result.streams:
            result.documents = documents_line(a, b)
        return True
    except (OSError, EOFError, ValueError) as exc:
        result.parts, result.streams = None, []
        result.documents = f"not read across parts: {type(exc).__name__}: {exc}"
        return False


def _explain(name: str, dir_a: Path | None, dir_b: Path | None) -> str:
    if dir_a is None or dir_b is None or not name.endswith(".npy"):
        return ""
    offset = first_difference([dir_a / name], [dir_b / name])
    if offset is None:
        return ""
    part = _part_index(name)
    if part is None:
        return f"first differing byte at offset {offset}"
    mask = dir_a / f"labels_mask_part_{part:04d}.npy"
    tokens = dir_a / f"token_ids_part_{part:04d}.npy"
    itemsize = 1
    if name.startswith("token_ids") and mask.exists() and mask.stat().st_size:
        itemsize = max(1, tokens.stat().st_size // mask.stat().st_size)
    return f"first differing byte at offset {offset}: " + locate(dir_a, part, offset // itemsize)
