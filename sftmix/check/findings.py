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

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sftmix.check.olmo_fit import STRATEGIES, OlmoCoreFit
from sftmix.check.parts import EXAMPLES, PartFacts, PartReading, read_parts
from sftmix.config.config import UNTRAINABLE_KEPT
from sftmix.errors import ConfigError
from sftmix.output.digest import RUN_REPORT
from sftmix.output.olmo_format import STATS_JSON, TOKENS_PART
from sftmix.output.part_writing import WrittenParts
from sftmix.runtime.storage import open_npy
from sftmix.tokenizing.literal_tokens import LiteralReport

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


@dataclass(frozen=True)
class Recorded:
    """What the run recorded of its output, given by the flow that just made it; each ``None`` is read from
    the output's ``run_report.json`` (or its statistics) instead, as ``tokenize-mixer check`` does."""

    token_dtype: str | None = None
    template: dict[str, Any] | None = None  # the template drift
    documents_file: str | None = None  # the run's document map
    dataset_names: list[str] | None = None  # in mixer order
    # the conversion's: a document of exactly this length without a final EOS was cut by the user's
    # setting, which is information, not a warning
    max_seq_length: int | None = None
    unrendered: list[str] | None = None  # what the plan found the template leaves out of the rows
    literal: LiteralReport | None = (
        None  # how spelled special tokens were read, and how many kept rows spell one
    )
    tokenizer_load_note: str | None = (
        None  # the reference's tokenizer makes other ids than its files ("": none)
    )
    # examples give each document's index in the output, unless it is a staged output that will not be
    # published (strict refuses one with findings: its document numbers open nothing)
    published: bool = True

    def filled(self, report: dict[str, Any], stats: dict[str, Any]) -> Recorded:
        """Every fact, those not given read from the run report and the statistics."""
        configuration = stats.get("configuration") or {}
        return Recorded(
            token_dtype=self.token_dtype or report.get("token_dtype") or "uint32",
            template=self.template or report.get("template_drift"),
            documents_file=self.documents_file or report.get("documents_file"),
            dataset_names=self.dataset_names or report.get("datasets") or [],
            max_seq_length=self.max_seq_length or configuration.get("max_sequence_length"),
            unrendered=self.unrendered if self.unrendered is not None else report.get("unrendered") or [],
            literal=self.literal or LiteralReport.of_report(report),
            tokenizer_load_note=(
                self.tokenizer_load_note
                if self.tokenizer_load_note is not None
                else report.get("tokenizer_load_note") or ""
            ),
            published=self.published,
        )


def check_output(
    output: str | Path,
    sequence_length: int | None = None,
    digests: bool = True,
    long_doc_strategy: str = "truncate",
    recorded: Recorded = Recorded(),
    written: WrittenParts | None = None,
) -> CheckReport:
    """``digests=False`` skips hashing the files again (the flow checks its staging right after computing
    them). With a ``sequence_length``, OLMo-core's datasets are simulated over the parts with
    ``long_doc_strategy``. ``recorded``: what the run recorded (read from ``run_report.json`` where not
    given). Examples name each document's dataset and source row (``inspect --dataset D --row R`` opens it).
    ``written``: the parts are being written; each chunk is read once it is."""
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
    facts = recorded.filled(report_json, stats)
    result = CheckReport(output=str(out), template=facts.template)
    reading = _reading(out, result, facts, sequence_length, long_doc_strategy)
    reading = dataclasses.replace(reading, hashed=digests, written=written)
    parts, result.digests = read_parts(reading)
    whole = PartFacts(olmo_core=OlmoCoreFit(sequence_length, long_doc_strategy) if sequence_length else None)
    for f in parts:
        whole.absorb(f)
    result.olmo_core = whole.olmo_core
    result.documents, result.tokens = whole.documents, whole.tokens
    result.trainable_tokens = whole.trainable_tokens
    _findings(result, whole, reading, facts, report_json)
    for entry in stats.get("per_dataset_statistics", []):
        tokens = entry.get("final_tokens_in_output") or 0
        result.per_dataset_trainable_percent[entry["dataset_name"]] = (
            round(100 * (entry.get("final_trainable_tokens_in_output") or 0) / tokens, 1) if tokens else 0.0
        )
    return result


def _reading(
    out: Path, result: CheckReport, facts: Recorded, sequence_length: int | None, long_doc_strategy: str
) -> PartReading:
    """How the parts are read, with the findings that need no read: data the template never renders, the
    tokenizer's load, a vocabulary the dtype cannot hold."""
    dtype = np.dtype(facts.token_dtype)
    vocab, eos, special = _tokenizer_facts(out)
    left_out = list(facts.unrendered or [])
    result.add(
        "template",
        "data in the rows that the chat template never renders (the model trains without it)",
        len(left_out),
        "items",
        left_out,
        summary=False,  # (the summary's unrendered line counts the rows)
    )
    note = facts.tokenizer_load_note or ""
    result.add("tokenizer", note, 1 if note else 0, "", summary=False)
    if vocab is None:
        result.add("integrity", "tokenizer/ is missing or unreadable", 1, "")
    elif vocab - 1 > np.iinfo(dtype).max:
        result.add("integrity", f"vocabulary of {vocab:,} ids does not fit dtype {dtype.name}", 1, "")
    return PartReading(
        out, dtype, vocab, eos, special, sequence_length, long_doc_strategy, facts.max_seq_length
    )


def _findings(
    result: CheckReport, whole: PartFacts, reading: PartReading, facts: Recorded, report_json: dict
) -> None:
    """The findings of the parts read whole, their examples named by the run's document map (read once:
    it names each example's dataset and row, and groups outliers)."""
    mapped = _document_map(facts.documents_file, result.documents)
    names = facts.dataset_names or []
    where = _document_namer(mapped, names, facts.published)
    _integrity_findings(result, whole, report_json.get("digests"))
    assert facts.literal is not None  # (filled)
    _mask_findings(result, whole, reading.special, where, facts.literal)
    _fit_findings_of(result, whole, where, reading.sequence_length, reading.max_seq_length)
    shares = np.concatenate(whole.shares) if whole.shares else np.zeros(0, np.float32)
    _share_outliers(result, shares, mapped, names, where)


def _integrity_findings(result: CheckReport, whole: PartFacts, recorded: Any) -> None:
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
    whole: PartFacts,
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
    whole: PartFacts,
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
