"""The configuration a user writes: one place to read every knob.

These pydantic models are what ``tokenize-mixer run CONFIG.yaml`` reads and what the Prefect UI shows
as the flow's parameter form, so every field carries a description and its constraints.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from sftmix.config.byte_settings import NO_BYTES, ChangesBytes
from sftmix.config.command_flags import Flag
from sftmix.config.form import blank_is_none, form_schema, lift_advanced
from sftmix.config.selection import BUDGET_PATTERN, Amount, TokenBudget, amount_text, parse_amount
from sftmix.errors import ConfigError

#: Every name of the reference's ``CHAT_TEMPLATES``, carried byte for byte (``sftmix/tokenizing/templates/<name>.jinja``),
#: in the reference's order. ``olmo_old`` is the same text as ``olmo`` under its own name.
NAMED_TEMPLATES = (
    "simple_concat_with_space",
    "simple_concat_with_new_line",
    "simple_chat",
    "assistant_message_only",
    "zephyr",
    "olmo",
    "tulu",
    "tulu_thinker",
    "tulu_thinker_r1_style",
    "olmo_old",
    "olmo_thinker",
    "olmo_thinker_no_think_7b",
    "olmo_thinker_remove_intermediate_thinking",
    "olmo_thinker_no_think_sft_tokenization",
    "olmo_thinker_rlzero",
    "olmo_thinker_code_rlzero",
    "r1_simple_chat",
    "r1_simple_chat_postpend_think",
    "r1_simple_chat_postpend_think_orz_style",
    "r1_simple_chat_postpend_think_tool_vllm",
    "qwen_instruct_user_boxed_math",
)


#: How a tokenizer is built: as the reference's transformers 5.4.0 builds it, or as its files say
#: (:mod:`sftmix.tokenizing.tokenizer_load`).
TokenizerLoad = Literal["reference", "files"]


#: What the UI form accepts as an amount: a whole number, a number with a '.', or a token budget.
AMOUNT_PATTERN = rf"^\s*(\d+|\d*\.\d+|\d+\.\d*|{BUDGET_PATTERN})\s*$"


#: The form's choice for the tokenizer's own chat_template (configs may also write 'tokenizer' or leave it out).
TOKENIZERS_OWN = "the tokenizer's own"


#: Bytes of token ids in a part of the reference's output (``convert_sft_data_for_olmocore.py``): ``part_bytes``'s
#: default.
REFERENCE_PART_BYTES = 1024**3


#: Optional text and lists: an empty form field means "not set".
OptionalText = Annotated[str | None, BeforeValidator(blank_is_none)]


OptionalList = Annotated[list[str] | None, BeforeValidator(blank_is_none)]


class DatasetEntry(BaseModel):
    """One dataset of the mixer and how much of it to take."""

    model_config = ConfigDict(
        extra="forbid",
        title="Dataset",
        json_schema_extra=form_schema(),
    )

    path: Annotated[str, ChangesBytes()] = Field(
        title="Dataset",
        description="A Hugging Face hub name (allenai/tulu-3-sft-mixture), a local .jsonl or .parquet file, or a "
        "gs:// path. It is recorded as typed in dataset_statistics.json. From the UI, a relative path is read "
        "from the worker's directory (where `prefect worker start` runs): give an absolute one.",
    )
    amount: Annotated[
        Amount,
        # Text in JSON and in the UI form: a JSON number loses 3.0 vs 3, which is a fraction vs a count.
        PlainSerializer(amount_text, return_type=str, when_used="json"),
        WithJsonSchema({"type": "string", "pattern": AMOUNT_PATTERN, "default": "1.0"}),
        ChangesBytes(),
    ] = Field(
        default=1.0,
        title="Amount",
        description='How much of the dataset to take. With a decimal point it is a share of its rows: "1.0" all of '
        'them, "0.25" a random quarter, "3.0" every row three times. A whole number is a count of rows: "100". '
        'A token budget (ours): "50M tokens" or "20M trainable tokens" (k, M, B) takes rows until their '
        "documents hold that many.",
        json_schema_extra={"default": "1.0"},
    )
    max_repeats: Annotated[float | None, BeforeValidator(blank_is_none), ChangesBytes(unrecorded=True)] = (
        Field(
            default=None,
            gt=0,
            title="Most repeats (token budget)",
            description="A token budget takes each row at most this many times (2.0: two passes over the dataset); "
            "the run says when it cut the budget there. Empty: as many as the budget needs.",
        )
    )
    split: Annotated[str, ChangesBytes()] = Field(
        default="train", title="Split", description="The dataset's split to read."
    )
    revision: Annotated[OptionalText, ChangesBytes()] = Field(
        default=None,
        title="Hub revision",
        description="A branch, tag or commit of a hub dataset, to pin it; empty for the latest.",
    )
    format: Annotated[Literal["auto", "messages", "alpaca", "sharegpt"], ChangesBytes()] = Field(
        default="auto",
        title="Row layout",
        description="auto: told from the columns. messages: a list of role/content messages. alpaca: "
        "instruction, input, output and system columns. sharegpt: conversations of from/value turns.",
    )
    messages_key: Annotated[OptionalText, ChangesBytes()] = Field(
        default=None,
        min_length=1,
        title="Messages column",
        description="The column that holds the messages, when it is not called 'messages'; empty for 'messages'.",
    )

    @field_validator("amount", mode="before")
    @classmethod
    def _parse_amount(cls, value: object) -> Amount:
        try:
            return parse_amount(value)  # type: ignore[arg-type]  # any input: parse_amount reads it or refuses it
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _repeats_need_a_budget(self) -> DatasetEntry:
        if self.max_repeats is not None and not isinstance(self.amount, TokenBudget):
            raise ValueError(f'max_repeats caps a token budget ("50M tokens"), not amount {self.amount}')
        return self


class TokenizerSpec(BaseModel):
    """Which tokenizer and chat template render the conversations."""

    model_config = ConfigDict(
        extra="forbid",
        title="Tokenizer",
        json_schema_extra=form_schema(
            advanced=(
                "revision",
                "load",
                "add_bos",
                "encoder",
                "unknown_template",
                "unrendered_data",
                "literal_special_tokens",
            ),
            title="More tokenizer options",
            description="Rarely changed: the defaults suit most runs.",
        ),
    )

    # (in slice keys as the tokenizer's fingerprint, with revision and load)
    name_or_path: Annotated[str, ChangesBytes()] = Field(
        title="Tokenizer",
        description="A hub name (allenai/OLMo-2-1124-7B) or a local directory with tokenizer.json, as "
        "transformers' AutoTokenizer takes it.",
    )
    # (in slice keys as the template's sha256, with chat_template_file and add_bos)
    chat_template: Annotated[OptionalText, ChangesBytes()] = Field(
        default=None,
        title="Chat template",
        description="How conversations become text: one of the reference's 21 named templates (tokenize-mixer "
        "carries them), or the template the tokenizer ships with.",
        # The form offers the choices; configs may also write 'tokenizer' or a path to a .jinja file.
        json_schema_extra={"enum": [TOKENIZERS_OWN, *NAMED_TEMPLATES], "default": TOKENIZERS_OWN},
    )
    chat_template_file: Annotated[OptionalText, ChangesBytes()] = Field(
        default=None,
        title="Chat template file",
        description="Or a path to a .jinja file with your own template; it replaces the choice above, which "
        "must then stay at the tokenizer's own. Empty for none.",
    )
    revision: Annotated[OptionalText, ChangesBytes()] = Field(
        default=None,
        title="Hub revision",
        description="A branch, tag or commit of a hub tokenizer, to pin it; empty for the latest.",
    )
    load: Annotated[TokenizerLoad, ChangesBytes(unrecorded=True), Flag("tokenizer_load")] = Field(
        default="reference",
        title="Tokenizer loading",
        description="reference: build the tokenizer as the reference's transformers 5.4.0 does, which for some "
        "tokenizers replaces the pre-tokenizer or normalizer its tokenizer.json names (the run warns before any "
        "work when that changes ids). files: tokenize as the tokenizer's own files say (tokenizer.json as it "
        "is); the output then differs from the reference's wherever the two differ.",
    )
    add_bos: Annotated[bool, ChangesBytes()] = Field(
        default=False,
        title="Add the BOS token",
        description="Put the tokenizer's bos token before each conversation (the reference's --add_bos).",
    )
    encoder: Annotated[Literal["auto", "hf", "fast"], NO_BYTES, Flag()] = Field(
        default="auto",
        title="Encoder",
        description="What makes the token ids. auto: a fast encoder (fastokens or tiktoken) where it is proven "
        "to give the tokenizer's exact ids (the run logs the proof), else the tokenizers library. hf: always "
        "the tokenizers library. fast: the fast encoder, or refuse the run.",
    )
    unknown_template: Annotated[Literal["error", "fallback"], NO_BYTES] = Field(
        default="error",
        title="Unknown template names",
        description="error: a template name tokenize-mixer does not know fails the run. fallback: use the "
        "tokenizer's own template with a loud warning, as the reference does (what `convert` uses).",
    )
    unrendered_data: Annotated[Literal["warn", "error"], NO_BYTES, Flag()] = Field(
        default="warn",
        title="Data the template never renders",
        description="A message field or role in the rows (tool_calls, a tool role, ...) that the chat template "
        "leaves out of its text. warn: say so and convert, as the reference does (the model trains without "
        "it). error: refuse the run before any work.",
    )
    literal_special_tokens: Annotated[
        Literal["keep", "split", "drop"], ChangesBytes(slices=True, unkeyed=True, unrecorded=True), Flag()
    ] = Field(
        default="keep",
        title="Special tokens written in the data",
        description="Text in the rows that spells a special token (a literal <|im_end|> in an answer). keep: "
        "the tokenizer reads it as that special token, as the reference does (the model learns to emit it "
        "mid-answer). split: read it as plain text; the template's own special tokens stay special. drop: "
        "skip such rows, counted.",
    )

    @model_validator(mode="before")
    @classmethod
    def _form_shape(cls, data: object) -> object:
        data = lift_advanced(data, "tokenizer")
        if isinstance(data, dict) and data.get("chat_template") == TOKENIZERS_OWN:
            data = {**data, "chat_template": None}
        return data

    @model_validator(mode="after")
    def _one_template(self) -> TokenizerSpec:
        if self.chat_template_file is not None:
            if self.chat_template is not None:
                raise ValueError(
                    f"give a chat template or a chat template file, not both ({self.chat_template!r} and "
                    f"{self.chat_template_file!r}): set the template to {TOKENIZERS_OWN!r} to use the file"
                )
            # one way to say it everywhere (statistics, recipes, the plan): the path is the template
            if not self.chat_template_file.endswith(".jinja"):
                raise ValueError(f"a chat template file is a .jinja file, not {self.chat_template_file!r}")
            self.chat_template, self.chat_template_file = self.chat_template_file, None
        return self


class OutputSpec(BaseModel):
    """Where the shards go and how they are laid out."""

    model_config = ConfigDict(
        extra="forbid",
        title="Output",
        json_schema_extra=form_schema(
            advanced=("token_dtype_rule", "packing", "parts", "part_bytes", "lineage"),
            title="More output options",
            description="Rarely changed: the defaults suit most runs.",
        ),
    )

    path: Annotated[str, NO_BYTES] = Field(
        title="Output directory",
        description="A local directory, or a gs://bucket/prefix. It is recorded in dataset_statistics.json. "
        "From the UI, a relative path is the worker's directory's (where `prefect worker start` runs): give "
        "an absolute one.",
    )
    overwrite: Annotated[bool, NO_BYTES, Flag()] = Field(
        default=False,
        title="Replace different shards",
        description="Off: a run into a directory that holds shards made from other settings or data is refused "
        "before any work. On: those shards are replaced.",
    )
    format: Annotated[Literal["olmo", "hf_parquet"], ChangesBytes()] = Field(
        default="olmo",
        title="Format",
        description="olmo: OLMo-core token and label parts, the reference's layout. hf_parquet: data/*.parquet "
        "with input_ids, labels (-100 = no loss) and attention_mask, for TRL and transformers' Trainer.",
    )
    # (in slice keys as the dtype it chooses)
    token_dtype_rule: Annotated[Literal["vocab_size", "largest_id"], ChangesBytes()] = Field(
        default="vocab_size",
        title="Token dtype rule",
        description="vocab_size: the token dtype follows the tokenizer's vocab_size, as in the reference (an id "
        "that does not fit fails the run). largest_id: added tokens count too.",
    )
    packing: Annotated[Literal["none", "best_fit_decreasing"], ChangesBytes()] = Field(
        default="none",
        title="Packing",
        description="hf_parquet only: pack documents into sequences of the max sequence length (best-fit "
        "decreasing), position_ids restarting at each document. OLMo-core packs the olmo format itself.",
    )

    parts: Annotated[Literal["reference", "whole_documents"], ChangesBytes(unrecorded=True), Flag()] = Field(
        default="reference",
        title="Parts",
        description="reference: a new part every part_bytes of token ids wherever a document lies, as the "
        "reference does; the document at each boundary is cut in two, and OLMo-core reads the pieces as two "
        "documents (or drops the head, reading by EOS). whole_documents: each part ends at the last document "
        "boundary within part_bytes, so every document is whole in one part (a document longer than "
        "part_bytes gets a part of its own).",
    )
    part_bytes: Annotated[int, ChangesBytes(unrecorded=True), Flag()] = Field(
        default=REFERENCE_PART_BYTES,
        ge=8,
        title="Part size (bytes of token ids)",
        description="The most bytes of token ids a part holds (its label mask holds one byte a token): "
        f"{REFERENCE_PART_BYTES:,} (1 GiB), the reference's. Smaller gives a small output several parts.",
    )

    lineage: Annotated[bool, ChangesBytes(unrecorded=True), Flag()] = Field(
        default=False,
        title="Lineage",
        description="Each document's dataset (its index in the mixer) and source row as two more columns of the "
        ".csv.gz boundary files, and each dataset's file fingerprint (or hub revision) in dataset_statistics.json. "
        "OLMo-core reads the first two columns only. Off: the reference's bytes.",
    )

    @model_validator(mode="before")
    @classmethod
    def _form_shape(cls, data: object) -> object:
        return lift_advanced(data, "output")

    @model_validator(mode="after")
    def _parts_need_olmo(self) -> OutputSpec:
        olmo_only = (self.parts, self.part_bytes, self.lineage) != ("reference", REFERENCE_PART_BYTES, False)
        if self.format != "olmo" and olmo_only:
            raise ValueError(
                "parts, part_bytes and lineage apply to format olmo (hf_parquet writes its own shards)"
            )
        return self

    @model_validator(mode="after")
    def _packing_needs_hf(self) -> OutputSpec:
        if self.packing != "none" and self.format != "hf_parquet":
            raise ValueError("packing applies to format hf_parquet; OLMo-core packs the olmo format itself")
        return self


#: Documents with no trainable token that a run kept (``drop_untrainable`` off), in its report's and
#: its check's words.
UNTRAINABLE_KEPT = "documents with no trainable token (kept: drop_untrainable is off)"


class MixerConfig(BaseModel):
    """A mixer: datasets with amounts, a tokenizer and template, a max length and where to write."""

    model_config = ConfigDict(
        extra="forbid",
        title="Mixer",
        json_schema_extra=form_schema(
            advanced=(
                "shuffle_seed",
                "num_examples",
                "mask",
                "mask_thinking",
                "mask_tool_calls",
                "mask_tool_outputs",
                "spans",
                "drop_untrainable",
                "on_bad_row",
            ),
            title="Masks, filters and shuffle",
            description="Which tokens are trained on and which rows are kept. The defaults make the reference's "
            "output.",
        ),
    )

    # (each slice's key holds its own dataset's rows, layout and data)
    datasets: Annotated[list[DatasetEntry], ChangesBytes()] = Field(
        min_length=1,
        title="Datasets",
        description="The datasets to mix, in order: their rows are shuffled together, and this order names "
        "them in the output's statistics.",
    )
    tokenizer: Annotated[TokenizerSpec, ChangesBytes()] = Field(title="Tokenizer and chat template")
    max_seq_length: Annotated[int | None, ChangesBytes(slices=True)] = Field(
        default=None,
        gt=0,
        title="Max sequence length",
        description="Cut each conversation to at most this many tokens (kept, as the reference keeps it: what "
        "becomes of a cut one is the next setting). Empty: no limit.",
    )
    over_length_strategy: Annotated[
        Literal["keep", "terminate", "drop"], ChangesBytes(unrecorded=True), Flag()
    ] = Field(
        default="keep",
        title="Conversations longer than the max length",
        description="What becomes of a conversation cut at max_seq_length (open-instruct's flag). keep: as the "
        "reference, it loses its end, EOS included, and its cut assistant text is trained on. terminate: where "
        "its last kept token is trained on, that token becomes EOS (still trained on), so the model learns to "
        "stop. drop: it is not trained on at all (removed, as a row with nothing to train on). Conversations "
        "that fit are the same under all three; changing it on a finished run tokenizes nothing again.",
    )
    output: Annotated[OutputSpec, ChangesBytes()] = Field(title="Output")
    shuffle_seed: Annotated[int, ChangesBytes()] = Field(
        default=42, ge=0, title="Shuffle seed", description="The seed of the shuffle of all kept rows."
    )
    num_examples: Annotated[int, ChangesBytes()] = Field(
        default=0,
        ge=0,
        title="Number of rows",
        description="Keep only the first this many rows after the shuffle; 0 keeps all.",
    )
    mask: Annotated[
        Literal["assistant", "last_turn", "all", "generation_tags"], ChangesBytes(slices=True, unkeyed=True)
    ] = Field(
        default="assistant",
        title="Trained tokens",
        description="assistant: every assistant turn, as the reference. last_turn: only the final assistant "
        "turn. all: every token. generation_tags: the text the template marks with {% generation %}, as "
        "transformers' return_assistant_tokens_mask.",
    )
    mask_thinking: Annotated[bool, ChangesBytes(slices=True, unkeyed=True), Flag()] = Field(
        default=False,
        title="Do not train on thinking",
        description="Beyond the reference, opt-in: assistant text from <think> through </think> (tags "
        "included; a </think> with no <think> in the turn counts from the turn's start, an unclosed <think> "
        "runs to the turn's end) is not trained on; the model still sees it. With mask: last_turn, only the "
        "final answer is trained on.",
    )
    mask_tool_calls: Annotated[bool, ChangesBytes(slices=True, unkeyed=True), Flag()] = Field(
        default=False,
        title="Do not train on tool calls",
        description="Beyond the reference, opt-in: what the template renders for an assistant message's "
        "tool calls (its function_calls or tool_calls field), tags included, is not trained on; the rest of "
        "the turn is.",
    )
    mask_tool_outputs: Annotated[bool, ChangesBytes(slices=True, unkeyed=True), Flag()] = Field(
        default=False,
        title="Do not train on tool outputs",
        description="Beyond the reference, opt-in: the content of tool results (roles tool, environment, "
        "ipython) is not trained on; only changes anything with mask: all (the assistant masks never train "
        "on them).",
    )
    spans: Annotated[Literal["reference", "exact"], ChangesBytes(slices=True, unkeyed=True), Flag()] = Field(
        default="reference",
        title="Assistant spans",
        description="reference: the reference's rule, byte for byte; it drops rows whose spans it cannot "
        "verify (a third of ShareGPT chats under olmo: those that open with an assistant turn). exact: beyond "
        "the reference, each assistant message's own characters through the end of its turn; such rows are "
        "kept and counted in the run report.",
    )
    drop_untrainable: Annotated[bool, ChangesBytes(slices=True, unkeyed=True)] = Field(
        default=True,
        title="Drop rows with nothing to train on",
        description="On, as the reference: a row with no trained token (its assistant text cut away, or spans "
        "the reference rule cannot verify) is dropped and counted. Off: it is kept with an all-zero mask.",
    )
    on_bad_row: Annotated[Literal["error", "skip"], ChangesBytes(recipe=False, slices=True), Flag()] = Field(
        default="error",
        title="Malformed rows",
        description="error: a malformed row (bad messages, a template error, a line of a .jsonl that is not a "
        "row) fails the run, naming its dataset and row (FILE:LINE for a line). skip: it is skipped and counted "
        "with its reason in the run report.",
    )

    @model_validator(mode="before")
    @classmethod
    def _form_shape(cls, data: object) -> object:
        return lift_advanced(data, "mixer")

    @model_validator(mode="after")
    def _packing_needs_a_length(self) -> MixerConfig:
        if self.output.packing != "none" and self.max_seq_length is None:
            raise ValueError("output.packing needs max_seq_length (the length of the packed sequences)")
        return self
