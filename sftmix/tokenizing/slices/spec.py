"""What a slice is asked to do: the run's context every slice shares (tokenizer, template, masking,
truncation, where to write) and one slice's rows of one dataset."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from sftmix.sources.reading import RowsAt
from sftmix.sources.registry import SliceSource
from sftmix.sources.whole.arrow import ArrowSource
from sftmix.tokenizing.masking import SETTINGS as MASKING_SETTINGS
from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.tokenizer import TokenizerKey, save_split_worker_tokenizer
from sftmix.tokenizing.tokenizer_load import TokenizerLoad


class TokenizeContext(BaseModel):
    """What every slice of a run shares: tokenizer, template, truncation, dtype, where to write."""

    tokenizer: str
    tokenizer_revision: str | None = None
    tokenizer_load: TokenizerLoad = "reference"
    tokenizer_file: str | None = None
    template_text: str
    token_dtype: str
    work_dir: str
    remote_work_dir: str | None = None
    datasets_cache: str
    on_bad_row: str = "error"
    masking: Masking  # the mixer's settings the masker follows, by their names (Masking.of)
    template_source: str = ""
    literal_special_tokens: str = "keep"  # (split: tokenizer_file is the renamed tokenizer)
    batch_size: int = 256
    encoder: str = "hf"  # "fast": the fast encoder, proven the same tokenizer by the plan (sftmix/tokenizing/encoders.py)
    # Not a slice setting (every slice records its over-length rows): whether the run's over_length_strategy
    # reads those records, so that a slice made before they were recorded is made again.
    over_length_recorded: bool = False

    def tokenizer_key(self) -> TokenizerKey:
        """The run's tokenizer, loaded as the plan loaded it."""
        return TokenizerKey.of(self.tokenizer, self.tokenizer_revision, self.tokenizer_load)


def workers_context(settings: dict[str, Any], **found: Any) -> TokenizeContext:
    """What every slice shares: the mixer's slice settings (:func:`sftmix.config.byte_settings.for_slices`,
    each a field here by its name, the masker's in its :class:`Masking`) and what the plan found. Spelled
    special tokens read as text need the workers' tokenizer with the template's own renamed (written once,
    beside the workers' copy)."""
    rest = {name: value for name, value in settings.items() if name not in MASKING_SETTINGS}
    ctx = TokenizeContext(**rest, masking=Masking.of(settings), **found)
    if ctx.literal_special_tokens == "split":
        assert ctx.tokenizer_file is not None
        ctx.tokenizer_file = save_split_worker_tokenizer(ctx.tokenizer_file, ctx.template_text)
    return ctx


class SliceSpec(BaseModel):
    """One unit of work: rows ``[row_start, row_end)`` of one dataset (or the listed subset)."""

    unrendered: list[str] = Field(
        default_factory=list,
        description="What the plan found the template leaves out of this dataset's rows (field:NAME, "
        "role:NAME): the slice counts the rows that hold each. Not part of the key (the template and rows are).",
    )

    key: str
    index: int
    dataset_index: int
    dataset: str
    split: str
    revision: str | None = None
    row_format: str = "messages"
    messages_key: str = "messages"
    row_start: int
    row_end: int
    rows: list[int] | None = Field(default=None, description="Selected rows; None = every row in the range.")
    source: SliceSource = Field(
        default_factory=lambda: ArrowSource(),
        description="Where its rows are, as its data format reads them (sftmix.sources.registry): a JSON Lines "
        "file's batches, a Parquet file's row groups, or the dataset datasets opens (its Arrow files).",
    )
    est_bytes: int = Field(
        default=0, description="Source bytes it holds, estimated: bigger slices start first."
    )

    def rows_at(self, datasets_cache: str = "") -> RowsAt:
        """Its dataset, for a format that reads its rows through it (a row's place needs no cache)."""
        return RowsAt(self.dataset, self.split, self.revision, datasets_cache)

    def row_list(self) -> list[int]:
        return list(range(self.row_start, self.row_end)) if self.rows is None else list(self.rows)

    def describe(self) -> str:
        return f"{self.dataset} rows {self.row_start}-{self.row_end - 1}"
