"""The configuration a user writes: one place to read every knob.

These pydantic models are what ``tokenize-mixer run CONFIG.yaml`` reads and what the Prefect UI shows
as the flow's parameter form, so every field carries a description and its constraints.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .selection import Amount, amount_text, parse_amount
from .templates import NAMED_TEMPLATES

#: What the UI form accepts as an amount: a whole number, or a number with a '.'.
AMOUNT_PATTERN = r"^\s*(\d+|\d*\.\d+|\d+\.\d*)\s*$"

#: The reference's template names, as a choice list (the UI form shows a select for it).
TemplateName = Literal[NAMED_TEMPLATES]  # type: ignore[valid-type]


class DatasetEntry(BaseModel):
    """One dataset of the mixer and how much of it to take."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        description="Hugging Face hub name, local .jsonl/.parquet file, or gs:// path. "
        "Written as typed into dataset_statistics.json."
    )
    amount: Annotated[
        float | int,
        # Text in JSON and in the UI form: a JSON number loses 3.0 vs 3, which is a fraction vs a count.
        PlainSerializer(amount_text, return_type=str, when_used="json"),
        WithJsonSchema({"type": "string", "pattern": AMOUNT_PATTERN, "default": "1.0"}),
    ] = Field(
        default=1.0,
        description="Written as text, by the reference's rule: with a '.' it is a fraction of the dataset "
        '("1.0" = all rows, "3.0" = upsample 3x, "0.25" = a random quarter); a whole number is a row '
        'count ("100"). YAML and Python numbers keep their kind (3.0 vs 3).',
        json_schema_extra={"default": "1.0"},
    )
    split: str = Field(default="train", description="Dataset split to read.")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit) to pin.")
    format: Literal["auto", "messages", "alpaca", "sharegpt"] = Field(
        default="auto",
        description="Row layout: 'messages' (role/content list), 'alpaca' (instruction, input, output, "
        "system), 'sharegpt' (conversations of from/value), or 'auto' (detected from the columns).",
    )
    messages_key: str | None = Field(
        default=None,
        min_length=1,
        description="Column holding the messages when it is not called 'messages' (implies format messages).",
    )

    @field_validator("amount", mode="before")
    @classmethod
    def _parse_amount(cls, value: object) -> Amount:
        try:
            return parse_amount(value)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise ValueError(str(exc)) from None


class TokenizerSpec(BaseModel):
    """Which tokenizer and chat template render the conversations."""

    model_config = ConfigDict(extra="forbid")

    name_or_path: str = Field(description="Local tokenizer directory or hub name (as for AutoTokenizer).")
    revision: str | None = Field(default=None, description="Hub revision of the tokenizer.")
    chat_template: TemplateName | str | None = Field(  # a choice list in the UI form, or any text
        default=None,
        description="One of the reference's 21 template names (carried by tokenize-mixer, e.g. 'olmo', "
        "'tulu', 'zephyr', 'olmo_thinker'), 'tokenizer' (or empty) for the tokenizer's own chat_template, "
        "or a path to a .jinja file.",
    )
    add_bos: bool = Field(
        default=False, description="Prepend the bos token to the chat template (reference --add_bos)."
    )
    encoder: Literal["auto", "hf", "fast"] = Field(
        default="auto",
        description="Which BPE encoder makes the token ids: 'auto' uses tiktoken where it is proven the same "
        "tokenizer (about 4x faster; the proof is logged) and the tokenizers library elsewhere; 'hf' always the "
        "tokenizers library; 'fast' refuses the run unless tiktoken is proven the same.",
    )
    unknown_template: Literal["error", "fallback"] = Field(
        default="error",
        description="What an unknown template name does: 'error' (our configs) or 'fallback' to the tokenizer's "
        "own template with a loud warning (the reference's behaviour, used by `convert`).",
    )


class OutputSpec(BaseModel):
    """Where the shards go and how they are laid out."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        description="Output directory: a local path, or a gs:// prefix (published with a manifest object "
        "written last). Recorded in dataset_statistics.json."
    )
    token_dtype_rule: Literal["vocab_size", "largest_id"] = Field(
        default="vocab_size",
        description="'vocab_size' picks the dtype from tokenizer.vocab_size like the reference (an id that does not "
        "fit fails the run); 'largest_id' also counts added tokens.",
    )
    overwrite: bool = Field(
        default=False, description="Replace an output directory that already holds different shards."
    )
    format: Literal["olmo", "hf_parquet"] = Field(
        default="olmo",
        description="'olmo': OLMo-core token/label parts (the reference's layout); 'hf_parquet': data/*.parquet "
        "with input_ids, labels (-100 = no loss) and attention_mask, for TRL and transformers' Trainer.",
    )
    packing: Literal["none", "best_fit_decreasing"] = Field(
        default="none",
        description="hf_parquet only: pack documents into max_seq_length sequences (best-fit decreasing), "
        "with position_ids restarting at each document. OLMo-core packs by itself (NumpyPackedFSLDatasetConfig).",
    )

    @model_validator(mode="after")
    def _packing_needs_hf(self) -> OutputSpec:
        if self.packing != "none" and self.format != "hf_parquet":
            raise ValueError("packing applies to format hf_parquet; OLMo-core packs the olmo format itself")
        return self


class MixerConfig(BaseModel):
    """A mixer: datasets with amounts, a tokenizer and template, a max length and where to write."""

    model_config = ConfigDict(extra="forbid")

    datasets: list[DatasetEntry] = Field(min_length=1, description="Datasets in mixer order.")
    tokenizer: TokenizerSpec
    max_seq_length: int | None = Field(
        default=None, gt=0, description="Truncate each conversation to this many tokens (not dropped)."
    )
    shuffle_seed: int = Field(default=42, ge=0, description="Seed of the global shuffle of kept rows.")
    num_examples: int = Field(
        default=0, ge=0, description="Keep only the first N rows after the shuffle (0 = all)."
    )
    mask: Literal["assistant", "last_turn", "all", "generation_tags"] = Field(
        default="assistant",
        description="Which tokens are trainable: 'assistant' (every assistant turn, as the reference), "
        "'last_turn' (only the final assistant turn), 'all' (every token), 'generation_tags' (the text a "
        "template marks with {% generation %}, as transformers' return_assistant_tokens_mask).",
    )
    mask_thinking: bool = Field(
        default=False,
        description="Beyond the reference, opt-in: assistant text from <think> through </think> (tags "
        "included; a </think> with no <think> in the turn counts from the turn's start, an unclosed <think> "
        "runs to the turn's end) is not trained on; the model still sees it. With mask: last_turn, only the "
        "final answer is trained on.",
    )
    mask_tool_calls: bool = Field(
        default=False,
        description="Beyond the reference, opt-in: what the template renders for an assistant message's "
        "tool calls (its function_calls or tool_calls field), tags included, is not trained on; the rest of "
        "the turn is.",
    )
    mask_tool_outputs: bool = Field(
        default=False,
        description="Beyond the reference, opt-in: the content of tool results (roles tool, environment, "
        "ipython) is not trained on; only changes anything with mask: all (the assistant masks never train "
        "on them).",
    )
    spans: Literal["reference", "exact"] = Field(
        default="reference",
        description="How assistant spans are found: 'reference' (the reference's rule, byte-compatible; it "
        "drops rows whose spans it cannot verify, e.g. a third of ShareGPT chats under olmo) or 'exact' "
        "(beyond the reference: where the template pastes message texts, each assistant content's exact "
        "characters through the end of its turn; such rows are kept and counted in run_report.json).",
    )
    drop_untrainable: bool = Field(
        default=True,
        description="Drop rows with no trainable token (all assistant text truncated away, or spans the "
        "reference rule cannot verify), as the reference's default chain with sft_tulu_filter_v1; false "
        "keeps them with an all-zero mask (the chain sft_tulu_tokenize_and_truncate_v1 alone).",
    )
    on_bad_row: Literal["error", "skip"] = Field(
        default="error",
        description="A malformed row (bad messages, a template error) fails the run naming dataset and row "
        "('error'), or is skipped and counted with its reason in the run report ('skip').",
    )
    output: OutputSpec

    @model_validator(mode="after")
    def _packing_needs_a_length(self) -> MixerConfig:
        if self.output.packing != "none" and self.max_seq_length is None:
            raise ValueError("output.packing needs max_seq_length (the length of the packed sequences)")
        return self


class RunOptions(BaseModel):
    """How to run: where checkpoints live, slice size, parallelism, validation."""

    model_config = ConfigDict(extra="forbid")

    work_dir: str | None = Field(
        default=None,
        description="Slice checkpoints and Prefect results: a local directory or a gs:// prefix shared by "
        "every worker (then a local mirror under the default work directory holds what this machine reads). "
        "Default: $TOKENIZE_MIXER_WORK_DIR or the user cache directory. Deleting it means starting cold.",
    )
    slice_rows: int | None = Field(
        default=None,
        gt=0,
        description="Source rows per slice (one task per slice); default: about slice_bytes of data per slice.",
    )
    slice_bytes: int = Field(
        default=4 * 2**20,
        gt=0,
        description="Target source bytes per slice when slice_rows is not set: small enough to balance the "
        "workers, large enough that orchestration costs little. Independent of the worker count, so "
        "checkpoints are reused whatever the parallelism.",
    )
    workers: int | None = Field(
        default=None, gt=0, description="Worker processes; default: the CPUs this process may use."
    )
    runner: Literal["auto", "process", "thread", "dask", "work_pool"] = Field(
        default="auto",
        description="'process' (a spawn process pool on this machine), 'dask' (a Dask cluster: dask_address, "
        "or a local cluster of `workers` processes), 'work_pool' (batches of slices as runs of the "
        "slice_deployment, on whichever machines' Prefect workers serve its pool; needs a gs:// work_dir), "
        "'thread' (in-process, for debugging), or 'auto': process when there is enough work for several "
        "workers, else in-process.",
    )
    slice_deployment: str = Field(
        default="tokenize-slices/cpu",
        description="runner 'work_pool': the deployment of the tokenize-slices flow that runs each batch.",
    )
    batch_slices: int = Field(
        default=16,
        gt=0,
        description="runner 'work_pool': slices per batch (one flow run of slice_deployment).",
    )
    dask_address: str | None = Field(
        default=None,
        description="Scheduler address of an existing Dask cluster (tcp://host:8786) for runner 'dask'; "
        "its workers need this package installed and the work directory reachable.",
    )
    reference: str | None = Field(
        default=None,
        description="A directory or digests JSON to validate the output against; a mismatch fails the run.",
    )
    force_recache: bool = Field(
        default=False, description="Recompute every slice, ignoring finished checkpoints, and overwrite them."
    )
    disable_cache: bool = Field(
        default=False,
        description="Neither read nor write checkpoints: slices go to a scratch directory removed after the run.",
    )
    check: Literal["report", "strict", "off"] = Field(
        default="report",
        description="`tokenize-mixer check` on the staged output before it is published (one more read of "
        "the shards): 'report' lists its findings in the run report and the UI, 'strict' fails the run on "
        "any finding and publishes nothing, 'off' skips it.",
    )
    allowed_roots: list[str] | None = Field(
        default=None,
        description="Local directories (absolute) and gs://bucket/prefix URLs that every path this run reads "
        "or writes must lie in: dataset files, a local tokenizer, a .jinja template, the output (strictly "
        "below a root), the work directory and the reference; hub names are not paths. None: no "
        "restriction. When the worker sets TOKENIZE_MIXER_ALLOWED_ROOTS, that bounds every run and these "
        "may only narrow it.",
    )


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def default_work_dir() -> Path:
    """``$TOKENIZE_MIXER_WORK_DIR``, else the user cache directory."""
    env = os.environ.get("TOKENIZE_MIXER_WORK_DIR")
    if env:
        return Path(env).expanduser()
    return user_cache_dir() / "tokenize-mixer"


def local_mirror(remote_work_dir: str) -> Path:
    """Where this machine keeps its copies of a remote work directory's files (slices it reads, the
    datasets cache, staging)."""
    tag = hashlib.sha256(remote_work_dir.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return default_work_dir() / "mirrors" / tag


class RunFile(BaseModel):
    """The file ``tokenize-mixer run`` reads: a mixer plus optional run options."""

    model_config = ConfigDict(extra="forbid")

    mixer: MixerConfig
    run: RunOptions = Field(default_factory=RunOptions)


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem, naming the field, instead of pydantic's wall of text."""
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def load_run_file(path: str | os.PathLike[str]) -> RunFile:
    """Read a YAML or JSON config. A file with top-level ``datasets`` is a bare mixer."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a mapping with 'mixer' (and optionally 'run')")
    if "datasets" in data:
        data = {"mixer": data}
    try:
        return RunFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(p))) from None
