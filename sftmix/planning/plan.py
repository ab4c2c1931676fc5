"""Plan a mixer: open each dataset, select its rows, and cut the work into content-keyed slices.

The plan is small and printable (``tokenize-mixer plan``). A slice's content key hashes everything
that changes its bytes, so an identical rerun finds every slice done and an edit recomputes only what
it touches.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from sftmix.config.byte_settings import keyed
from sftmix.config.config import DatasetEntry, MixerConfig, TokenizerSpec
from sftmix.config.run_options import RunOptions, default_work_dir, local_mirror
from sftmix.config.selection import TokenBudget, large_upsample_warning
from sftmix.errors import ConfigError, DatasetError, TemplateError
from sftmix.output.olmo_format import part_bytes_problem
from sftmix.planning.encoder_choice import choose_encoder
from sftmix.planning.recipe import input_record, mixer_recipe
from sftmix.planning.samples import probed, rendered_samples, sampled_tokens_per_row, tokenizer_load_note
from sftmix.planning.slice_sizes import cuts_batches, size_text, slice_bytes_for, slicing_summary
from sftmix.planning.slicing import EarlySlice, Slicing
from sftmix.planning.span_losses import span_losses
from sftmix.runtime.parallel import memory_limit
from sftmix.runtime.storage import is_remote, storage_errors
from sftmix.sources import jsonl, parquet
from sftmix.sources.data_files import forget_builders
from sftmix.sources.hashing import hash_ahead
from sftmix.sources.parquet.spill import forget_spills
from sftmix.sources.paths import path_problem
from sftmix.sources.reading import SAMPLE_ROWS, DatasetPlan, Opened, Planning
from sftmix.sources.registry import READERS, WHOLE
from sftmix.sources.whole.arrow import release_mapped_data
from sftmix.tokenizing.slices import (
    SLICE_FORMAT_VERSION,
    SliceOutput,
    SliceSpec,
    TokenizeContext,
    WorkerTemplate,
    WorkerTokenizer,
)
from sftmix.tokenizing.templates import (
    ChatRenderer,
    ResolvedTemplate,
    check_template_name,
    has_generation_tags,
    read_template_file,
    resolve_template,
)
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    tokenizer_path_problem,
)
from sftmix.tokenizing.tokenizer_facts import TokenizerFacts, tokenizer_facts, worker_tokenizer_file

logger = logging.getLogger(__name__)


#: What each ``over_length_strategy`` makes of a conversation cut at ``max_seq_length``, in the plan's words.
OVER_LENGTH_FATES = {
    "keep": "cut without EOS, their cut end trained on, as the reference; terminate ends each with a trainable "
    "EOS, drop removes them",
    "terminate": "each whose cut falls in trained text ends with a trainable EOS",
    "drop": "removed, not trained on",
}


class Plan(BaseModel):
    mixer: MixerConfig
    context: TokenizeContext
    datasets: list[DatasetPlan]
    slices: list[SliceSpec]
    template_source: str
    template_sha256: str
    tokenizer_fingerprint: str
    warnings: list[str]
    unrendered: list[str] = []  # (also in warnings) data the template leaves out, in words
    tokenizer_load_note: str | None = None  # (also in warnings) the reference's tokenizer is not its files'
    inputs: dict | None = None  # the input files' stamps, taken before the plan read them (up_to_date)
    slicing: str = ""  # how the slices were sized, in words (the summary's)
    seconds: float = 0.0  # how long making it took
    made_ahead: bool = False  # made by the command while the Prefect API started, and handed to the flow
    eos_id: int | None = None  # the tokenizer's EOS (what over_length_strategy terminate writes)

    def recipe(self) -> dict[str, Any]:
        """Everything the output's bytes follow from (and nothing they do not: run options, the
        encoder, overwrite, the output's own path): written into the published output's marker, so
        that a rerun into it can tell before any work whether it would make different shards."""
        return {
            "format": SLICE_FORMAT_VERSION,
            "mixer": mixer_recipe(self.mixer),
            "data": [d.fingerprint for d in self.datasets],
            "tokenizer": self.tokenizer_fingerprint,
            "template": self.template_sha256,
            "token_dtype": self.context.output.token_dtype,
        }

    def size_line(self) -> str:
        """What the run will make, estimated from the sampled rows: tokens, and bytes of slices (each
        row once) and of output (each selected row; tokens and masks)."""
        per_token = np.dtype(self.context.output.token_dtype).itemsize + 1
        tokens = sum(d.estimated_tokens() for d in self.datasets)
        distinct = sum(d.estimated_tokens(distinct=True) for d in self.datasets)
        rows = sum(d.target for d in self.datasets)
        return (
            f"size        ~{tokens:,} tokens in {rows:,} rows (estimated from up to {SAMPLE_ROWS} sampled rows a "
            f"dataset): ~{size_text(distinct * per_token)} of slices in the work dir, ~{size_text(tokens * per_token)} "
            "of output"
        )

    def over_length_lines(self) -> list[str]:
        """Each dataset whose sampled rows run past ``max_seq_length``: the share, and what the run's
        ``over_length_strategy`` will make of them."""
        strategy = self.mixer.over_length_strategy
        fate = OVER_LENGTH_FATES[strategy]
        return [
            f"over length ~{d.over_length_share:.0%} of {d.name}'s sampled rows are longer than max_seq_length "
            f"{self.mixer.max_seq_length} (over_length_strategy {strategy}: {fate})"
            for d in self.datasets
            if d.over_length_share > 0
        ]

    def summary(self, warnings: bool = True) -> str:
        """The plan in lines; ``warnings=False`` leaves out what the plan logged as it found it."""
        m = self.mixer
        wide = max([8, *(len(str(d.amount)) for d in self.datasets)])
        lines = [
            f"tokenizer   {m.tokenizer.name_or_path} (fingerprint {self.tokenizer_fingerprint[:12]})",
            f"template    {m.tokenizer.chat_template or '(tokenizer)'} -> {self.template_source} "
            f"(sha256 {self.template_sha256[:12]})",
            f"max length  {m.max_seq_length}; token dtype {self.context.output.token_dtype}; shuffle seed {m.shuffle_seed}"
            + (f"; first {m.num_examples} rows" if m.num_examples else ""),
            f"work dir    {self.context.output.remote_work_dir or self.context.output.work_dir}",
            f"output      {m.output.path}",
            "",
            f"{'#':>3}  {'dataset':<40} {'split':<8} {'amount':>{wide}} {'rows':>9} {'selected':>9} {'slices':>6}",
        ]
        for d in self.datasets:
            lines.append(
                f"{d.index:>3}  {d.name:<40} {d.split:<8} {d.amount!s:>{wide}} {d.n_rows:>9} "
                f"{('~' if isinstance(d.amount, TokenBudget) else '') + str(d.target):>9} {len(d.slices):>6}"
            )
        lines.append(f"\n{len(self.slices)} slices" + (f", {self.slicing}" if self.slicing else ""))
        lines.append(self.size_line())
        lines += self.over_length_lines()
        for w in self.warnings if warnings else []:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


def _work_dir_path(run: RunOptions) -> Path:
    """The local work directory (a remote one's local mirror), not created."""
    if run.work_dir and is_remote(run.work_dir):
        return local_mirror(run.work_dir)
    return Path(run.work_dir).expanduser() if run.work_dir else default_work_dir()


def _work_dir(run: RunOptions) -> tuple[Path, str | None]:
    """The local work directory (created) and the remote one it mirrors, if any."""
    remote = run.work_dir if is_remote(run.work_dir) else None
    work_dir = _work_dir_path(run)
    with storage_errors(f"work directory {work_dir} is not usable"):
        work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir, remote


def _read_by_us(entry: DatasetEntry) -> bool:
    """Whether the plan reads the dataset's local file itself (by batch or row group), not through
    ``datasets`` (whose file the plan hashes ahead)."""
    path, split = entry.path, entry.split
    return (
        jsonl.applies(path, split)
        or jsonl.reads_decompressed(path, split)
        or jsonl.reads_remote(path, split)
        or parquet.applies(path, split)
        or parquet.reads_remote(path, split)
    )


def check_inputs(mixer: MixerConfig, run: RunOptions | None = None) -> None:
    """Refuse what is wrong at a glance (a missing tokenizer directory, ``.jinja`` template or data
    file; a hub name with no hub to ask), in the plan's order and with its messages: the command checks
    this before it starts a Prefect API, in a fraction of a second, where the plan would meet it seconds
    later. Nothing is opened or downloaded (the plan does that, while the API starts); the hub is one
    name lookup, made only for a name that is not a local path."""
    spec = mixer.tokenizer
    if (problem := tokenizer_path_problem(spec.name_or_path)) is not None:
        raise ConfigError(problem)
    if spec.chat_template and spec.chat_template.endswith(".jinja"):
        read_template_file(spec.chat_template)
    check_template_name(spec.chat_template, spec.unknown_template)
    caches = [] if run is None else [str(_work_dir_path(run) / "datasets-cache")]
    for entry in mixer.datasets:
        if (problem := path_problem(entry.path, caches)) is not None:
            raise DatasetError(entry.path, problem)


def prepare_plan(mixer: MixerConfig, run: RunOptions) -> None:
    """Do the slow, cached part of :func:`build_plan` ahead of it (while the Prefect API starts): load
    the tokenizer and write the workers' copy, open every dataset (its Arrow conversion) and hash its
    file. Everything lands in this process's caches or in files the plan writes anyway, so the plan
    that follows produces the same result, only sooner. Errors are left for the plan to report."""
    forget_builders()
    try:
        work_dir, _ = _work_dir(run)
    except Exception as exc:  # the plan meets the same error and reports it properly
        logger.debug("preparing the plan stopped early: %s: %s", type(exc).__name__, exc)
        return
    datasets_cache = str(work_dir / "datasets-cache")

    def open_datasets() -> None:
        try:
            for entry in mixer.datasets:
                next(reader for reader in READERS if reader.ahead(entry, datasets_cache))
        except Exception as exc:
            logger.debug("opening the datasets ahead of the plan stopped: %s: %s", type(exc).__name__, exc)

    # The datasets' Arrow conversion (one core each, the longest part) beside the tokenizer's load.
    hash_ahead([entry.path for entry in mixer.datasets if not _read_by_us(entry)])
    datasets_ahead = threading.Thread(target=open_datasets, name="datasets-ahead", daemon=True)
    datasets_ahead.start()
    try:
        tk = TokenizerKey.of(mixer.tokenizer.name_or_path, mixer.tokenizer.revision, mixer.tokenizer.load)
        worker_tokenizer_file(tk, work_dir / "tokenizers")
    except Exception as exc:
        logger.debug("loading the tokenizer ahead of the plan stopped: %s: %s", type(exc).__name__, exc)
    finally:
        datasets_ahead.join()


def resolve_tokenizer(spec: TokenizerSpec) -> tuple[TokenizerKey, TokenizerFacts, ResolvedTemplate]:
    """The tokenizer (its key and what the run needs to know of it) and the chat template it renders with."""
    tk = TokenizerKey.of(spec.name_or_path, spec.revision, spec.load)
    facts = tokenizer_facts(tk)
    template = resolve_template(
        spec.chat_template,
        facts.chat_template,
        spec.name_or_path,
        unknown=spec.unknown_template,
        add_bos=spec.add_bos,
        bos_token=facts.bos_token,
    )
    return tk, facts, template


def _context(
    mixer: MixerConfig,
    tk: TokenizerKey,
    template: ResolvedTemplate,
    dtype: str,
    work_dir: Path,
    remote: str | None,
) -> TokenizeContext:
    """What every slice of the run shares (the workers' copy of the tokenizer written once, here)."""
    tokenizer = WorkerTokenizer.of(mixer.tokenizer, tk, worker_tokenizer_file(tk, work_dir / "tokenizers"))
    output = SliceOutput(
        work_dir=str(work_dir),
        remote_work_dir=remote,
        datasets_cache=str(work_dir / "datasets-cache"),
        token_dtype=dtype,
        over_length_recorded=mixer.over_length_strategy != "keep" and mixer.max_seq_length is not None,
    )
    return TokenizeContext.of(
        mixer, tokenizer, WorkerTemplate(text=template.text, source=template.source), output
    )


def _opened(index: int, entry: DatasetEntry, at: Planning) -> Opened:
    """The dataset opened by the first reader that reads it (:data:`READERS`; the last reads any)."""
    for reader in READERS:
        if (dataset := reader.open(index, entry, at)) is not None:
            return dataset
    raise AssertionError(f"no reader opened {entry.path}")


def build_plan(mixer: MixerConfig, run: RunOptions, early: EarlySlice | None = None) -> Plan:
    """The plan. ``early`` is handed each slice of a large JSON Lines file as soon as it is cut, while the
    plan still reads the rest of the file (the same slices the plan returns)."""
    started = time.perf_counter()
    inputs = input_record(mixer)  # first: a file that changes while the plan reads it will not match
    forget_builders()
    work_dir, remote = _work_dir(run)
    tk, facts, template = resolve_tokenizer(mixer.tokenizer)
    _refuse_before_work(mixer, template, facts)
    dtype = facts.token_dtype(mixer.output.token_dtype_rule)
    ctx = _context(mixer, tk, template, dtype.name, work_dir, remote)
    at = Planning(run, work_dir, ctx.on_bad_row, memory_limit(), WHOLE)
    slicing = Slicing(_shared_key(mixer, facts, template, dtype), ctx, early)
    renderer = ChatRenderer(template.text, facts.special_tokens)
    hash_ahead([entry.path for entry in mixer.datasets if not _read_by_us(entry)])
    opened: list[Opened] = []
    for index, entry in enumerate(mixer.datasets):  # each dataset's head: enough to sample its rows
        at.selected_total = sum(d.plan.target for d in opened if d.plan is not None)
        opened.append(dataset := _opened(index, entry, at))
        probed(dataset, at, slicing, mixer.tokenizer, renderer, template)
    rendered = [rendered_samples(renderer, d, slicing) for d in opened]  # the sample rows, rendered once
    texts = [text for texts in rendered for text in texts]
    load_note = tokenizer_load_note(tk, facts, ctx, texts)
    encoder = choose_encoder(mixer.tokenizer, tk, ctx, texts)
    # (the same context object the head start and the slicing hold: they see the encoder chosen)
    ctx.tokenizer = ctx.tokenizer.model_copy(update={"encoder": encoder})
    tokens_per_row = sampled_tokens_per_row(ctx, rendered)
    data_bytes = sum(d.nbytes for d in opened)
    at.slice_bytes, at.cut_batches = slice_bytes_for(run, data_bytes), cuts_batches(run, data_bytes)
    datasets, slices = slicing.cut(opened, at)
    for d, (per_row, over) in zip(datasets, tokens_per_row, strict=True):
        d.tokens_per_row, d.over_length_share = per_row, over
    _estimate_budgets(datasets, opened, at, ctx)
    _refuse_part_bytes(mixer, dtype, datasets)
    span_losses(datasets, opened, ctx)
    _release_reads()
    left_out = [line for d in opened for line in d.left_out]
    return Plan(
        mixer=mixer,
        context=ctx,
        datasets=datasets,
        slices=slices,
        template_source=template.source,
        template_sha256=template.sha256,
        tokenizer_fingerprint=facts.fingerprint,
        eos_id=facts.eos_id,
        warnings=[*([load_note] if load_note else []), *(w for d in opened for w in d.warnings), *left_out],
        tokenizer_load_note=load_note,
        unrendered=left_out,
        inputs=inputs,
        slicing=slicing_summary(run, data_bytes, slices),
        seconds=round(time.perf_counter() - started, 3),
    )


def _refuse_before_work(mixer: MixerConfig, template: ResolvedTemplate, facts: TokenizerFacts) -> None:
    """Settings the template or the tokenizer cannot honour, refused before any dataset is read."""
    if mixer.mask == "generation_tags" and not has_generation_tags(template.text):
        raise TemplateError(
            f"mask generation_tags needs a template that marks assistant text with {{% generation %}} ... "
            f"{{% endgeneration %}}; template {template.source} has no such block"
        )
    if (
        mixer.over_length_strategy == "terminate"
        and mixer.max_seq_length is not None
        and facts.eos_id is None
    ):
        raise ConfigError(
            f"over_length_strategy terminate ends a cut conversation with EOS, and tokenizer "
            f"{mixer.tokenizer.name_or_path!r} has none (no eos_token); choose keep or drop"
        )


def _shared_key(
    mixer: MixerConfig, facts: TokenizerFacts, template: ResolvedTemplate, dtype: np.dtype
) -> dict:
    """What every slice's key holds besides its rows."""
    return {
        "format": SLICE_FORMAT_VERSION,
        "tokenizer": facts.fingerprint,
        "template": template.sha256,
        "dtype": dtype.name,
        **keyed(mixer),  # the settings a slice's tokens follow from (sftmix/config/byte_settings.py)
    }


def _refuse_part_bytes(mixer: MixerConfig, dtype: np.dtype, datasets: list[DatasetPlan]) -> None:
    """An OLMo-core output whose part size cannot hold what the estimate says it must."""
    if mixer.output.format == "olmo":
        tokens = sum(d.estimated_tokens() for d in datasets)
        if (
            problem := part_bytes_problem(
                mixer.output.part_bytes,
                dtype,
                mixer.max_seq_length,
                tokens,
                mixer.output.parts == "whole_documents",
            )
        ) is not None:
            raise ConfigError(problem)


def _release_reads() -> None:
    """What the plan's reads keep (every row was read to fingerprint it; workers map their own)."""
    release_mapped_data(datasets_too=True)
    jsonl.release()
    parquet.release()
    forget_spills()


def _estimate_budgets(
    datasets: list[DatasetPlan], opened: list[Opened], at: Planning, ctx: TokenizeContext
) -> None:
    """Each token budget's rows, estimated from its sampled rows' tokens (trainable ones through the run's
    masker), for the plan's sizes and its refusals; the rows are chosen from their tokens once they are
    tokenized (``selection.budget_selection``)."""
    budgets = [d for d in datasets if isinstance(d.amount, TokenBudget)]
    for d in budgets:
        assert isinstance(d.amount, TokenBudget)
        per_row = d.tokens_per_row
        if d.amount.trainable:
            samples = [conv for _, conv in opened[d.index].samples]
            per_row = ctx.trainable_per_row(samples) or per_row
        rows = math.ceil(d.amount.tokens / per_row) if per_row > 0 else d.n_rows
        d.target = max(1, rows if d.max_repeats is None else min(rows, int(d.max_repeats * d.n_rows)))
    for d in budgets:
        entry = opened[d.index].entry
        at.selected_total = sum(other.target for other in datasets if other is not d)
        at.check_selection(entry, d.n_rows, d.target)
        if (w := large_upsample_warning(entry.path, d.amount, d.n_rows, d.target)) is not None:
            opened[d.index].warnings.append(w)
            logger.warning(w)
