"""``tokenize-mixer check OUT``: will this output train the way its maker thinks, before a GPU hour is
spent on it. Reads the shards part by part in bounded chunks (memory does not grow with the output).

Findings, each with a kind and a count:
- integrity: token and mask files of equal length, boundaries that tile each part, ids that fit the dtype
  and the vocabulary of ``tokenizer/``, digests equal to ``run_report.json``'s;
- fit: documents longer than the training sequence length, EOS tokens inside a document (OLMo-core
  cuts documents at EOS when it finds boundaries that way);
- masks: documents with no trainable token, special tokens trained in the middle of trainable text (a
  role header or marker the model would learn to emit; one that ends a trainable run is a turn's end),
  documents whose trainable share is an outlier for their dataset;
- OLMo-core fit at a sequence length (``olmo_fit``) and template drift (``templates.template_drift``).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sftmix.check.olmo_fit import STRATEGIES, OlmoCoreFit
from sftmix.config.config import UNTRAINABLE_KEPT
from sftmix.errors import ConfigError
from sftmix.output.digest import RUN_REPORT, artifact_digest, digested_files
from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, STATS_JSON, TOKENS_PART, parse_boundaries
from sftmix.output.part_writing import WrittenParts
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import open_npy, pread_into
from sftmix.tokenizing.literal_tokens import LiteralReport

#: Tokens read at once per part: bounded memory whatever the part size (about 15 MiB of arrays per chunk
#: in flight, a few per thread).
CHUNK = 1 << 20
#: Examples kept per finding.
EXAMPLES = 5


#: How much a finding matters, most first: the output is wrong; training silently differs from what the
#: data says (a document cut at an EOS inside it, a marker learned mid-answer); or it follows from the
#: user's own settings and is counted for information (truncation by max_seq_length, outliers, padding).
BROKEN, CHANGES_TRAINING, INFORMATION = "broken", "changes training", "information"
SEVERITIES = (BROKEN, CHANGES_TRAINING, INFORMATION)
#: ``tokenize-mixer check``'s exit status by the worst finding (information alone exits 0).
EXIT_BY_SEVERITY = {BROKEN: 3, CHANGES_TRAINING: 1, INFORMATION: 0}
#: How each severity starts a console line.
SEVERITY_WORDS = {BROKEN: "BROKEN", CHANGES_TRAINING: "WARNING", INFORMATION: "note"}


@dataclass
class Finding:
    kind: str  # integrity | fit | masks | template | tokenizer
    what: str
    count: int
    examples: list[Any] = field(default_factory=list)
    unit: str = ""  # what ``count`` counts (documents, parts, tokens ...); empty for a single fact
    severity: str = CHANGES_TRAINING
    in_summary: bool = False  # said in a run's summary (what changes training, not said there otherwise)

    def line(self, examples: bool = True) -> str:
        """The finding in one line, its count in words: ``[fit] ...: 3 documents (e.g. document 4)``."""
        counted = f": {self.count:,} {self.unit}" if self.unit else ""
        example = f" (e.g. {', '.join(map(str, self.examples))})" if self.examples and examples else ""
        return f"[{self.kind}] {self.what}{counted}{example}"

    def console_line(self) -> str:
        """:meth:`line`, led by its severity in words."""
        return f"{SEVERITY_WORDS[self.severity]} ({self.severity}) {self.line()}"


@dataclass
class CheckReport:
    output: str
    documents: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    findings: list[Finding] = field(default_factory=list)
    per_dataset_trainable_percent: dict[str, float] = field(default_factory=dict)
    olmo_core: OlmoCoreFit | None = None  # with a sequence length: what OLMo-core's datasets will make of it
    template: dict[str, Any] | None = None  # the template used against the tokenizer's own (run_report.json)
    digests: dict[str, str] | None = None  # every artifact's digest, hashed in the same read as the check

    @property
    def clean(self) -> bool:
        """Nothing broken and nothing that changes training (findings for information may remain)."""
        return not self.serious

    @property
    def serious(self) -> list[Finding]:
        """The findings that are not for information only, worst first."""
        return sorted(
            (f for f in self.findings if f.severity != INFORMATION),
            key=lambda f: SEVERITIES.index(f.severity),
        )

    @property
    def exit_code(self) -> int:
        """0 when clean, 1 when something changes training, 3 when something is broken."""
        return max((EXIT_BY_SEVERITY[f.severity] for f in self.findings), default=0)

    def add(
        self,
        kind: str,
        what: str,
        count: int,
        unit: str,
        examples: list[Any] | None = None,
        severity: str | None = None,
        summary: bool | None = None,
    ) -> None:
        """A finding of ``count`` ``unit`` (plural: documents, parts, tokens ...), when there are any;
        integrity findings are broken, the others change training unless ``severity`` says otherwise.
        ``summary``: whether a run's summary says it (default: unless it is for information only)."""
        if count:
            if count == 1 and unit.endswith("s"):
                unit = unit[:-1]
            severity = severity or (BROKEN if kind == "integrity" else CHANGES_TRAINING)
            said = severity != INFORMATION if summary is None else summary
            self.findings.append(
                Finding(kind, what, int(count), list(examples or [])[:EXAMPLES], unit, severity, said)
            )

    def summary_lines(self) -> list[str]:
        """What a run's summary says of the check: each finding that changes training (or breaks the
        output), and the documents the settings cut, a line each without examples (the log has them)."""
        return [f.line(examples=False) for f in self.findings if f.in_summary]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "clean": self.clean, "exit_code": self.exit_code}, indent=2)

    def notes(self) -> list[str]:
        """What was measured besides the findings: OLMo-core fit and template drift."""
        return [
            *(self.olmo_core.render() if self.olmo_core is not None else []),
            *_template_lines(self.template),
        ]

    def render(self, template_diff: bool = False) -> str:
        """The report as text; ``template_diff`` adds the diff of a template that differs from the
        tokenizer's own (tokenizer's -> used)."""
        lines = [
            f"checked {self.output}: {self.documents:,} documents, {self.tokens:,} tokens "
            f"({self.trainable_tokens:,} trainable)"
        ]
        for name, pct in self.per_dataset_trainable_percent.items():
            lines.append(f"  trainable {pct:5.1f}%  {name}")
        lines += self.notes()
        if template_diff and self.template is not None:
            lines += [f"    {line}" for line in self.template.get("diff", [])]
        ordered = sorted(self.findings, key=lambda f: SEVERITIES.index(f.severity))
        lines += [f.console_line() for f in ordered]
        if self.clean:
            notes = len(self.findings)
            lines.append(
                "clean: nothing broken, nothing that changes training"
                + (f" ({notes} note{'s' if notes > 1 else ''} for information above)" if notes else "")
            )
        return "\n".join(lines)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _tokenizer_facts(out: Path) -> tuple[int | None, int | None, dict[int, str]]:
    """(vocabulary size, eos id, special added tokens other than eos by id) of ``tokenizer/``."""
    config = _json(out / "tokenizer" / "tokenizer_config.json")
    spec = _json(out / "tokenizer" / "tokenizer.json")
    if not spec:
        return None, None, {}
    vocab = spec.get("model", {}).get("vocab") or {}
    added = spec.get("added_tokens") or []
    ids = [int(v) for v in (vocab.values() if isinstance(vocab, dict) else range(len(vocab)))]
    ids += [int(t["id"]) for t in added]
    size = max(ids) + 1 if ids else None
    eos_token = config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    eos = next((int(t["id"]) for t in added if t.get("content") == eos_token), None)
    if eos is None and isinstance(vocab, dict) and eos_token in vocab:
        eos = int(vocab[eos_token])
    special = {int(t["id"]): str(t.get("content")) for t in added if t.get("special") and int(t["id"]) != eos}
    return size, eos, special


def check_output(
    output: str | Path,
    sequence_length: int | None = None,
    digests: bool = True,
    token_dtype: str | None = None,
    long_doc_strategy: str = "truncate",
    template: dict[str, Any] | None = None,
    documents_file: str | None = None,
    dataset_names: list[str] | None = None,
    max_seq_length: int | None = None,
    published: bool = True,
    unrendered: list[str] | None = None,
    written: WrittenParts | None = None,
    literal: LiteralReport | None = None,
    tokenizer_load_note: str | None = None,
) -> CheckReport:
    """``digests=False`` skips hashing the files again and ``token_dtype`` gives the dtype otherwise read
    from ``run_report.json`` (the flow checks its staging right after computing both). With a
    ``sequence_length``, OLMo-core's datasets are simulated over the parts with ``long_doc_strategy``.
    ``template`` is the template drift the run recorded, ``documents_file`` the run's document map and
    ``dataset_names`` its datasets in mixer order (all read from ``run_report.json`` otherwise);
    ``max_seq_length`` the conversion's (read from the statistics otherwise): a document of exactly that
    length without a final EOS was truncated by the user's setting, which is information, not a warning.
    Examples name each document's dataset and source row (``inspect --dataset D --row R`` opens it), and its
    index in the output unless ``published`` is false (a staged output that will not be published).
    ``unrendered``: what the plan found the template leaves out of the rows (``run_report.json``'s
    otherwise). ``written``: the parts are being written; each chunk is read once it is. ``literal``: how
    the rows' spelled special tokens were read and how many kept rows spell one (``run_report.json``'s
    otherwise). ``tokenizer_load_note``: the plan's warning that the reference's tokenizer makes other ids
    than its own files ("" for none; ``run_report.json``'s otherwise)."""
    if long_doc_strategy not in STRATEGIES:
        raise ConfigError(
            f"long_doc_strategy must be one of {', '.join(STRATEGIES)}, not {long_doc_strategy!r}"
        )
    out = Path(output)
    if not (out / TOKENS_PART.format(0)).exists():
        raise ConfigError(
            f"{out} holds no {TOKENS_PART.format(0)}: not an OLMo-core output of tokenize-mixer"
        )
    report_json, stats = _json(out / RUN_REPORT), _json(out / STATS_JSON)
    if max_seq_length is None:
        max_seq_length = (stats.get("configuration") or {}).get("max_sequence_length")
    dtype = np.dtype(token_dtype or report_json.get("token_dtype") or "uint32")
    vocab, eos, special = _tokenizer_facts(out)
    result = CheckReport(output=str(out), template=template or report_json.get("template_drift"))
    left_out = unrendered if unrendered is not None else report_json.get("unrendered") or []
    result.add(
        "template",
        "data in the rows that the chat template never renders (the model trains without it)",
        len(left_out),
        "items",
        list(left_out),
        summary=False,  # (the summary's unrendered line counts the rows)
    )
    if tokenizer_load_note is None:
        tokenizer_load_note = report_json.get("tokenizer_load_note") or ""
    result.add("tokenizer", tokenizer_load_note, 1 if tokenizer_load_note else 0, "", summary=False)
    if vocab is None:
        result.add("integrity", "tokenizer/ is missing or unreadable", 1, "")
    elif vocab - 1 > np.iinfo(dtype).max:
        result.add("integrity", f"vocabulary of {vocab:,} ids does not fit dtype {dtype.name}", 1, "")

    facts = _read_parts(
        out,
        result,
        digests,
        dtype=dtype,
        vocab=vocab,
        eos=eos,
        special=special,
        sequence_length=sequence_length,
        long_doc_strategy=long_doc_strategy,
        max_seq_length=max_seq_length,
        written=written,
    )
    fit = OlmoCoreFit(sequence_length, long_doc_strategy) if sequence_length is not None else None
    whole = _PartFacts(olmo_core=fit)
    for f in facts:
        whole.absorb(f)
    result.olmo_core = whole.olmo_core
    result.documents, result.tokens, result.trainable_tokens = (
        whole.documents,
        whole.tokens,
        whole.trainable_tokens,
    )
    # the run's document map, read once: it names each example's dataset and row, and groups outliers
    mapped = _document_map(documents_file or report_json.get("documents_file"), result.documents)
    names = dataset_names or report_json.get("datasets") or []
    where = _document_namer(mapped, names, published)
    _integrity_findings(result, whole, report_json.get("digests"))
    _mask_findings(result, whole, special, where, literal or LiteralReport.of_report(report_json))
    _fit_findings_of(result, whole, where, sequence_length, max_seq_length)
    shares = np.concatenate(whole.shares) if whole.shares else np.zeros(0, np.float32)
    _share_outliers(result, shares, mapped, names, where)
    for entry in stats.get("per_dataset_statistics", []):
        tokens = entry.get("final_tokens_in_output") or 0
        result.per_dataset_trainable_percent[entry["dataset_name"]] = (
            round(100 * (entry.get("final_trainable_tokens_in_output") or 0) / tokens, 1) if tokens else 0.0
        )
    return result


def _read_parts(out: Path, result: CheckReport, digests: bool, **options: Any) -> list[_PartFacts]:
    """Each part's facts (and, with ``digests``, every file's digest into ``result``). Each part is read
    once, in order, by one thread (its files hashed as they are read); the chunks' checks run on a pool of
    every core (numpy and hashlib release the GIL)."""
    count = 0
    while (out / TOKENS_PART.format(count)).exists():
        count += 1
    threads = max(1, min(available_cpus(), MAX_PART_THREADS))
    with (
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix="check-chunk") as chunks,
        ThreadPoolExecutor(max_workers=max(1, min(count, threads)), thread_name_prefix="check-part") as pool,
    ):
        check = functools.partial(
            _check_part, out, chunks=chunks if threads > 1 else None, hashed=digests, **options
        )
        facts = list(pool.map(check, range(count)))
        if digests:
            result.digests = _all_digests(out, facts, pool)
    return facts


def _integrity_findings(result: CheckReport, whole: _PartFacts, recorded: Any) -> None:
    """Parts that do not hold together, and files that are not the ones the run recorded."""
    result.add(
        "integrity",
        "parts whose token and mask files differ in length",
        len(whole.uneven),
        "parts",
        whole.uneven,
    )
    result.add(
        "integrity",
        "parts whose document boundaries do not tile the part",
        len(whole.untiled),
        "parts",
        whole.untiled,
    )
    result.add(
        "integrity", "token ids beyond the tokenizer's vocabulary", len(whole.too_big), "parts", whole.too_big
    )
    if result.digests is not None and isinstance(recorded, dict) and recorded:
        actual = result.digests
        differ = sorted(k for k in recorded if actual.get(k) != recorded[k])
        result.add(
            "integrity", "files whose digest differs from run_report.json", len(differ), "files", differ
        )


def _mask_findings(
    result: CheckReport,
    whole: _PartFacts,
    special: dict[int, str],
    where: Callable[[int], str],
    literal: LiteralReport,
) -> None:
    """Documents with nothing to train on, and special tokens trained inside trainable text."""
    result.add(
        "masks",
        UNTRAINABLE_KEPT,
        whole.empty.count,
        "documents",
        [where(d) for d in whole.empty.examples],
        INFORMATION,
    )
    remedy = literal.remedy()
    result.add("masks", literal.SPELLED, literal.spelled_count(), "rows", severity=INFORMATION)
    for tok_id, docs in sorted(whole.special_trained.items()):
        result.add(
            "masks",
            f"documents that train special token {special.get(tok_id, '?')} (id {tok_id}) inside trainable "
            f"text (a header or marker the model would learn to emit mid-answer{remedy})",
            docs.count,
            "documents",
            [where(d) for d in docs.examples],
        )


def _fit_findings_of(
    result: CheckReport,
    whole: _PartFacts,
    where: Callable[[int], str],
    sequence_length: int | None,
    max_seq_length: int | None,
) -> None:
    """Where the documents' EOS and lengths do not fit what OLMo-core reads (and, with a sequence length,
    what its datasets would make of them)."""
    result.add(
        "fit",
        "documents with an EOS token before their end",
        whole.eos_inside.count,
        "documents",
        [where(d) for d in whole.eos_inside.examples],
    )
    result.add(
        "fit",
        "documents that do not end with EOS (OLMo-core's default boundaries, by EOS, join each to the next "
        "document)",
        whole.no_final_eos.count,
        "documents",
        [where(d) for d in whole.no_final_eos.examples],
    )
    result.add(
        "fit",
        f"documents truncated at max_seq_length {max_seq_length}, their EOS with them (OLMo-core's default "
        "boundaries, by EOS, join each to the next document; over_length_strategy terminate, "
        "--over_length_strategy terminate, ends each one cut in trained text with a trainable EOS)",
        whole.truncated_no_eos.count,
        "documents",
        [where(d) for d in whole.truncated_no_eos.examples],
        INFORMATION,
        summary=True,  # (the settings asked for it, and it changes what is trained)
    )
    if sequence_length is not None:
        result.add(
            "fit",
            f"documents longer than sequence length {sequence_length}",
            whole.long_docs.count,
            "documents",
            [where(d) for d in whole.long_docs.examples],
            INFORMATION,
        )
    result.add(
        "fit",
        "documents cut in two by a part boundary (the reference's layout: OLMo-core reads the pieces as two "
        "documents, or, finding documents by EOS, drops the first piece); `output.parts: whole_documents` "
        "(--parts whole_documents) keeps every document whole",
        whole.cut_by_parts.count,
        "documents",
        [where(d) for d in whole.cut_by_parts.examples],
    )
    if result.olmo_core is not None:
        unended = whole.no_final_eos.count or whole.cut_by_parts.count
        _fit_findings(result, result.olmo_core, CHANGES_TRAINING if unended else INFORMATION)


#: Threads that read parts and check their chunks (each holds a few chunks' arrays at a time).
MAX_PART_THREADS = 64
#: Chunks of one part read ahead of their checks.
READ_AHEAD = 2


def _all_digests(out: Path, facts: list[_PartFacts], pool: ThreadPoolExecutor) -> dict[str, str]:
    """The output's digests as ``output_digests`` gives them: the parts' from their one read, the rest
    (statistics, anything else the output holds) hashed now."""
    known = {name: digest for f in facts for name, digest in f.digests.items()}
    files = {p.relative_to(out).as_posix(): p for p in digested_files(out)}
    rest = [name for name in files if name not in known]
    known.update(zip(rest, pool.map(artifact_digest, [files[name] for name in rest]), strict=True))
    return {name: known[name] for name in files}


@dataclass
class _Documents:
    """How many documents a finding counts, and the first few (the examples it shows): what a finding
    holds does not grow with the output. Documents come in order; one seen again (cut by a chunk's edge)
    is counted once."""

    count: int = 0
    examples: list[int] = field(default_factory=list)
    last: int = -1

    def add(self, docs: np.ndarray | list[int], base: int = 0) -> None:
        """``docs``: ascending document numbers (from ``base``), none before the last ones added."""
        docs = np.asarray(docs, dtype=np.int64) + base
        docs = docs[docs > self.last]
        if docs.size:
            self.count += int(docs.size)
            self.examples += docs[: EXAMPLES - len(self.examples)].tolist()
            self.last = int(docs[-1])

    def drop_last(self) -> None:
        """The last document added is not one of these after all."""
        if self.examples and self.examples[-1] == self.last:
            self.examples.pop()
        self.count -= 1

    def merge(self, other: _Documents, base: int) -> None:
        """A later part's (its documents numbered from ``base`` here)."""
        self.count += other.count
        self.examples += [base + d for d in other.examples[: EXAMPLES - len(self.examples)]]
        self.last = base + other.last if other.count else self.last


@dataclass
class _PartFacts:
    """What one part shows; document numbers are the part's own (the caller adds the documents before)."""

    tokens: int = 0
    documents: int = 0
    trainable_tokens: int = 0
    uneven: list[str] = field(default_factory=list)
    untiled: list[str] = field(default_factory=list)
    too_big: list[str] = field(default_factory=list)
    empty: _Documents = field(default_factory=_Documents)
    long_docs: _Documents = field(default_factory=_Documents)
    eos_inside: _Documents = field(default_factory=_Documents)
    no_final_eos: _Documents = field(default_factory=_Documents)  # last token not EOS (but those below)
    truncated_no_eos: _Documents = field(default_factory=_Documents)  # the same, cut at max_seq_length
    special_trained: dict[int, _Documents] = field(default_factory=dict)  # documents, by token id
    olmo_core: OlmoCoreFit | None = None
    trainable_share: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # per document
    digests: dict[str, str] = field(default_factory=dict)  # of the part's files, from the check's read
    shares: list[np.ndarray] = field(default_factory=list)  # the later parts' trainable_share, absorbed
    open_end: bool = False  # the last document lacks its EOS (and was not truncated): the next part goes on
    cut_by_parts: _Documents = field(default_factory=_Documents)  # documents a part boundary cut

    def absorb(self, later: _PartFacts) -> None:
        """A later part's facts, its documents numbered on from this one's: where this one's last document
        goes on in the later part (the reference's layout cuts it there), its two pieces are one document."""
        cut = int(self.open_end and later.documents > 0)
        if cut:
            self.no_final_eos.drop_last()  # (its piece in this part has no EOS: it goes on)
            self.cut_by_parts.add([self.documents - 1])
        base = self.documents - cut
        self.open_end = later.open_end
        self.shares.append(later.trainable_share[cut:])
        if self.olmo_core is not None and later.olmo_core is not None:
            self.olmo_core.merge(later.olmo_core)
        self.uneven += later.uneven
        self.untiled += later.untiled
        self.too_big += later.too_big
        for name in ("empty", "long_docs", "eos_inside", "no_final_eos", "truncated_no_eos"):
            getattr(self, name).merge(getattr(later, name), base)
        for tok_id, docs in later.special_trained.items():
            self.special_trained.setdefault(tok_id, _Documents()).merge(docs, base)
        self.documents += later.documents - cut
        self.tokens += later.tokens
        self.trainable_tokens += later.trainable_tokens


def _check_part(
    out: Path,
    part: int,
    dtype: np.dtype,
    vocab: int | None,
    eos: int | None,
    special: dict[int, str],
    sequence_length: int | None,
    long_doc_strategy: str = "truncate",
    chunks: ThreadPoolExecutor | None = None,
    hashed: bool = False,
    max_seq_length: int | None = None,
    written: WrittenParts | None = None,
) -> _PartFacts:
    """One part's files, read once in order in bounded chunks (hashed as read when ``hashed``); the
    chunks are checked on ``chunks`` (here without it) and their facts added up in order."""
    f = _PartFacts()
    tokens_file, mask_file = out / TOKENS_PART.format(part), out / MASK_PART.format(part)
    token_bytes, mask_bytes = (
        tokens_file.stat().st_size,
        mask_file.stat().st_size if mask_file.exists() else 0,
    )
    bounds_file = out / BOUNDS_PART.format(part)
    bounds = np.zeros((0, 2), np.int64)
    if bounds_file.exists():
        text = gzip.decompress(bounds_file.read_bytes())
        if hashed:
            f.digests[bounds_file.name] = hashlib.sha256(text).hexdigest()
        bounds = parse_boundaries(text)
    n = f.tokens = token_bytes // dtype.itemsize
    f.documents = bounds.shape[0]
    starts, ends = bounds[:, 0], bounds[:, 1]
    if mask_bytes != n or token_bytes % dtype.itemsize:  # its documents cannot be read token by token
        f.uneven.append(f"part {part}: {token_bytes} token bytes ({dtype.name}), {mask_bytes} mask bytes")
    elif (
        bounds.shape[0] == 0
        or starts[0] != 0
        or ends[-1] != n
        or np.any(starts[1:] != ends[:-1])
        or np.any(ends <= starts)
    ):
        f.untiled.append(f"part {part}")
    if f.uneven or f.untiled:
        if written is not None:
            written.wait(part)
        if hashed:
            f.digests.update({p.name: artifact_digest(p) for p in (tokens_file, mask_file) if p.exists()})
        return f
    lengths = ends - starts
    done_trainable = np.zeros(bounds.shape[0], np.int64)  # trainable tokens up to each doc's end
    chunk = functools.partial(
        _check_chunk, ends=ends, vocab=vocab, eos=eos, special_ids=np.array(sorted(special), np.int64)
    )
    carried = 0
    eos_at: list[np.ndarray] = []  # where OLMo-core's default finds document ends

    def add(c: _ChunkFacts) -> None:
        nonlocal carried
        if c.too_big is not None:
            f.too_big.append(f"part {part} offset {c.too_big}")
        done_trainable[c.ending] = c.trainable_at_ends + carried
        carried += c.trainable
        if c.eos_at is not None:
            eos_at.append(c.eos_at)
            f.eos_inside.add(c.eos_inside)
            cut = lengths[c.unended] == max_seq_length if max_seq_length else np.zeros(c.unended.size, bool)
            unended, truncated = c.unended[~cut], c.unended[cut]
            f.no_final_eos.add(unended)
            f.open_end = f.open_end or bool(unended.size and unended[-1] == bounds.shape[0] - 1)
            f.truncated_no_eos.add(truncated)
        for tok_id, docs in c.special_trained.items():  # a document cut by chunks is one document
            f.special_trained.setdefault(tok_id, _Documents()).add(docs)

    digests = _read_in_chunks(tokens_file, mask_file, dtype, part, n, chunk, add, chunks, written, hashed)
    f.digests.update(digests)
    trainable = np.diff(done_trainable, prepend=0)
    f.trainable_share = (trainable / np.maximum(lengths, 1)).astype(np.float32)
    f.empty.add(np.flatnonzero(trainable == 0))
    if sequence_length is not None:
        f.long_docs.add(np.flatnonzero(lengths > sequence_length))
    f.trainable_tokens = int(trainable.sum())
    if sequence_length is not None:
        f.olmo_core = OlmoCoreFit(sequence_length, long_doc_strategy)
        f.olmo_core.add_part(starts, ends, n, np.concatenate(eos_at) if eos is not None else None)
    return f


def _read_in_chunks(
    tokens_file: Path,
    mask_file: Path,
    dtype: np.dtype,
    part: int,
    n: int,
    chunk: Callable[..., _ChunkFacts],
    add: Callable[[_ChunkFacts], None],
    chunks: ThreadPoolExecutor | None,
    written: WrittenParts | None,
    hashed: bool,
) -> dict[str, str]:
    """A part's ``n`` tokens and mask bytes read once, in order, in chunks checked by ``chunk`` (on
    ``chunks``, a few read ahead) and added in order; the two files' digests when ``hashed``."""
    token_hash, mask_hash = hashlib.sha256(), hashlib.sha256()
    pending: deque[Future[_ChunkFacts]] = deque()
    try:
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            if written is not None:
                written.wait(part, min(n, hi + 1))
            t = _read_span(tokens_file, dtype, lo, hi)
            with_next = _read_span(mask_file, np.dtype(np.uint8), lo, min(n, hi + 1))
            if written is not None:
                written.read(part, hi)
            # (``a.data``: ``memoryview(a)``, which numpy's stubs allow from Python 3.12 only)
            if hashed:
                token_hash.update(t.data)
                mask_hash.update(with_next[: hi - lo].data)
            if chunks is None:
                add(chunk(t, with_next, lo))
                continue
            pending.append(chunks.submit(chunk, t, with_next, lo))
            while len(pending) > READ_AHEAD:
                add(pending.popleft().result())
        while pending:
            add(pending.popleft().result())
    finally:
        for waiting in pending:
            waiting.cancel()
    if not hashed:
        return {}
    return {tokens_file.name: token_hash.hexdigest(), mask_file.name: mask_hash.hexdigest()}


@dataclass
class _ChunkFacts:
    """What tokens ``[lo, lo + CHUNK)`` of a part show, to be added up in the part's order."""

    too_big: int | None  # the first offset of an id beyond the vocabulary
    ending: np.ndarray  # the documents that end in the chunk
    trainable_at_ends: np.ndarray  # trainable tokens of the chunk up to each of their ends
    trainable: int  # trainable tokens of the chunk
    eos_at: np.ndarray | None  # offsets of EOS tokens (None without an EOS)
    eos_inside: np.ndarray  # documents with an EOS before their end (ascending)
    unended: np.ndarray  # documents ending here whose last token is not EOS
    special_trained: dict[int, np.ndarray]  # documents that train each special token mid-text (ascending)


def _check_chunk(
    t: np.ndarray,
    with_next: np.ndarray,
    lo: int,
    ends: np.ndarray,
    vocab: int | None,
    eos: int | None,
    special_ids: np.ndarray,
) -> _ChunkFacts:
    """Tokens ``t`` from offset ``lo`` with their mask bytes and the next chunk's first mask byte."""
    hi = lo + t.shape[0]
    with_next = with_next.astype(bool)
    m = with_next[: hi - lo]
    too_big = None
    if vocab is not None and t.size and int(t.max()) >= vocab:
        too_big = lo + int(np.argmax(t >= vocab))
    # documents ending in this chunk (ends are sorted: the boundaries tile the part)
    ending = np.arange(np.searchsorted(ends, lo, side="right"), np.searchsorted(ends, hi, side="right"))
    cuts = ends[ending] - lo  # where each ends in the chunk (ascending: no document is empty)
    last = np.zeros(hi - lo, dtype=bool)  # a document's last token
    last[cuts - 1] = True
    # trainable tokens of the chunk up to each end: a sum per document (a running sum of every token
    # was the check's largest cost)
    at_ends = np.zeros(cuts.shape[0], np.int64)
    if cuts.size:
        np.cumsum(np.add.reduceat(m[: cuts[-1]], np.r_[0, cuts[:-1]], dtype=np.int64), out=at_ends)
    facts = _ChunkFacts(
        too_big=too_big,
        ending=ending,
        trainable_at_ends=at_ends,
        trainable=int(np.count_nonzero(m)),
        eos_at=None,
        eos_inside=np.zeros(0, np.int64),
        unended=np.zeros(0, np.int64),
        special_trained={},
    )
    if eos is not None:
        every_eos = np.flatnonzero(t == eos)
        facts.eos_at = every_eos + lo
        at = every_eos[~last[every_eos]]  # not a document's last token
        facts.eos_inside = np.unique(np.searchsorted(ends, lo + at, side="right"))
        facts.unended = ending[t[ends[ending] - 1 - lo] != eos]
    if special_ids.size:  # trained and followed by trained text: a header or marker, not a turn's end
        at = _positions_of(t, special_ids)
        follows = at + 1 < with_next.shape[0]
        follows[follows] = with_next[at[follows] + 1]
        at = at[m[at] & follows & ~last[at]]
        docs = np.searchsorted(ends, lo + at, side="right")
        for tok_id in np.unique(t[at]).tolist():
            facts.special_trained[int(tok_id)] = np.unique(docs[t[at] == tok_id])
    return facts


def _positions_of(t: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Where ``t`` holds one of ``ids`` (ascending). Special tokens are rare in text and most tokenizers
    number them above the text's, so the candidates at or above the lowest are found first, and the
    table lookup runs on them alone; where they are not rare, on every token."""
    lowest = int(ids[0])
    if lowest > 0:
        above = t >= lowest
        if np.count_nonzero(above) * RARE < t.shape[0]:
            candidates = np.flatnonzero(above)
            return candidates[np.isin(t[candidates], ids, kind="table")]
    return np.flatnonzero(np.isin(t, ids, kind="table"))


#: Candidates fewer than one in this many tokens are looked up one by one (``_positions_of``).
RARE = 8


def _read_span(path: Path, dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
    """Items ``[lo, hi)`` of a raw array file, read into memory: a map read through would keep every
    page it touched resident until closed, so checking a large part would grow with the part."""
    data = np.empty(hi - lo, dtype=dtype)
    view, position = data.data.cast("B"), lo * dtype.itemsize
    fd = os.open(path, os.O_RDONLY)
    try:
        left = pread_into(fd, view, position)
        if left:
            raise ConfigError(
                f"{path} ended at byte {position + len(view) - left} while it was being checked"
            )
    finally:
        os.close(fd)
    return data


#: Padding share of packed instances above which the packing is a finding (a third of every batch
#: wasted is what users have found after the fact).
PADDING_FINDING_PERCENT = 25.0


def _fit_findings(result: CheckReport, fit: OlmoCoreFit, unread: str) -> None:
    """``unread``: the severity of tokens after a part's last EOS (information where only documents
    truncated by max_seq_length lack their EOS)."""
    L = fit.sequence_length
    if fit.packable and fit.packed.padding_percent(L) > PADDING_FINDING_PERCENT:
        result.add(
            "fit",
            f"packed FSL instances of {L} would be {fit.packed.padding_percent(L):.1f}% padding "
            f"(more than {PADDING_FINDING_PERCENT:.0f}%)",
            fit.packed.instances,
            "instances",
            severity=INFORMATION,
        )
    if fit.packed_by_eos.tokens_unread:
        result.add(
            "fit",
            "tokens after a part's last EOS: OLMo-core's default (boundaries by EOS) never reads them",
            fit.packed_by_eos.tokens_unread,
            "tokens",
            severity=unread,
        )


def _template_lines(drift: dict[str, Any] | None) -> list[str]:
    """One line: the template used, the tokenizer's own and their hashes. The diff stays out of the
    run's log and the text report (a page of template source buries the findings): ``check --json``
    keeps it and ``check --template_diff`` prints it."""
    if drift is None:
        return ["template: not recorded (an output made before tokenize-mixer recorded template drift)"]
    used = f"template: {drift.get('source')} (sha256 {str(drift.get('used_sha256'))[:12]})"
    if drift.get("shipped") == "same":
        return [f"{used}, the same text as the tokenizer's own chat_template"]
    if drift.get("shipped") == "none":
        return [
            f"{used}; the tokenizer ships no chat_template: evaluate with this output's tokenizer/, "
            "which carries the one used"
        ]
    return [
        f"{used} DIFFERS from the tokenizer's own chat_template (sha256 {str(drift.get('shipped_sha256'))[:12]}): "
        "evaluate with this output's tokenizer/, which carries the one used (the diff: check --template_diff, "
        "or --json FILE)"
    ]


#: A document's trainable share is an outlier for its dataset beyond this many interquartile ranges of
#: the log share (at least a factor OUTLIER_MIN_RATIO) outside the dataset's middle half: with
#: alike documents, 8x below or above it. Datasets of fewer documents are skipped.
OUTLIER_IQRS, OUTLIER_MIN_RATIO, OUTLIER_MIN_DOCUMENTS = 3.0, 2.0, 20


def _document_map(documents_file: str | None, documents: int) -> np.ndarray | None:
    """The run's document map (dataset and source row of each document), or ``None`` when it is gone
    (its work directory was cleaned) or is not this output's."""
    try:
        mapped = open_npy(documents_file) if documents_file else None
    except (OSError, ValueError):
        return None
    return mapped if mapped is not None and mapped.shape[0] == documents else None


def _dataset_name(names: list[str], k: int) -> str:
    return names[k] if k < len(names) else f"dataset {k}"


def _document_namer(mapped: np.ndarray | None, names: list[str], published: bool) -> Callable[[int], str]:
    """How an example names a document: its dataset and source row, from the run's document map (what
    ``inspect --dataset D --row R`` opens, and what a user can find in the data), then its index in the
    output where there is one to open; the index alone when the map is gone."""
    if mapped is None:
        return lambda d: f"document {d}"

    def where(d: int) -> str:
        record = mapped[d]
        source = f"{_dataset_name(names, int(record['dataset']))} row {int(record['row'])}"
        return f"{source} (document {d})" if published else source

    return where


def _share_outliers(
    result: CheckReport,
    shares: np.ndarray,
    documents: np.ndarray | None,
    names: list[str],
    where: Callable[[int], str],
) -> None:
    """Documents whose trainable share is far from the rest of their dataset's: a template that lost
    its markers on some rows, a conversation with a huge user turn, a mask that bled into a header."""
    if documents is None or documents.shape[0] != shares.shape[0]:
        return  # the document map is gone (its work directory was cleaned): nothing to group by
    dataset = np.asarray(documents["dataset"])
    found, examples = 0, []
    for k in np.unique(dataset).tolist():
        idx = np.flatnonzero((dataset == k) & (shares > 0))  # no trainable token: its own finding
        if idx.size < OUTLIER_MIN_DOCUMENTS:
            continue
        logs = np.log(shares[idx])
        q1, q3 = np.quantile(logs, [0.25, 0.75])
        spread = max(float(q3 - q1), float(np.log(OUTLIER_MIN_RATIO)))
        out = idx[(logs < q1 - OUTLIER_IQRS * spread) | (logs > q3 + OUTLIER_IQRS * spread)]
        q1, q3 = np.exp(q1), np.exp(q3)
        found += out.size
        name = _dataset_name(names, k)
        examples += [
            f"{where(int(d))}: {100 * float(shares[d]):.1f}% trainable, the middle half of {name} "
            f"{100 * float(q1):.0f}-{100 * float(q3):.0f}%"
            for d in out[:EXAMPLES].tolist()
        ]
    result.add(
        "masks",
        "documents whose trainable share is an outlier for their dataset",
        found,
        "documents",
        examples,
        INFORMATION,
    )
