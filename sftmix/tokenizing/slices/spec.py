"""What a slice is asked to do: the run's context every slice shares (tokenizer, template, masking and
truncation, where to write) and one slice's rows of one dataset."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from sftmix.config.config import MixerConfig
from sftmix.sources.formats import Conversation
from sftmix.sources.reading import RowsAt
from sftmix.sources.registry import SliceSource
from sftmix.sources.whole.arrow import ArrowSource
from sftmix.tokenizing.labels import LabelMasker, RenderError
from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.row_status import RowStatus, TokenizedRow
from sftmix.tokenizing.slices.encoding import WorkerTemplate, WorkerTokenizer, cached_masker
from sftmix.tokenizing.slices.manifest import SKELETONS


class SliceOutput(BaseModel):
    """Where each slice is written and how: the work directory (its mirror, with a remote one beside it),
    the datasets' cache in it, the tokens' dtype, and whether the slice must hold its over-length records."""

    work_dir: str
    remote_work_dir: str | None = None
    datasets_cache: str
    token_dtype: str
    # Not a slice setting (every slice records its over-length rows): whether the run's over_length_strategy
    # reads those records, so that a slice made before they were recorded is made again.
    over_length_recorded: bool = False


class TokenizeContext(BaseModel):
    """What every slice of a run shares, as the specs that build what a worker runs: the tokenizer's
    encoding, the template's renderer, the masker, and where slices are written, with what a worker does
    with a bad row. Each of the mixer's slice settings is held once under its own name, in a spec or here
    (``on_bad_row``): ``tests/test_byte_settings.py`` finds each."""

    tokenizer: WorkerTokenizer
    template: WorkerTemplate
    masking: Masking  # the mixer's settings the masker follows (Masking.of)
    output: SliceOutput
    on_bad_row: str = "error"
    batch_size: int = 256

    @classmethod
    def of(
        cls, mixer: MixerConfig, tokenizer: WorkerTokenizer, template: WorkerTemplate, output: SliceOutput
    ) -> TokenizeContext:
        """The run's context: the mixer's settings for the masker and the rows, with what the plan found."""
        return cls(
            tokenizer=tokenizer.with_template(template.text),
            template=template,
            masking=Masking.of(mixer),
            output=output,
            on_bad_row=mixer.on_bad_row,
        )

    def masker(self) -> LabelMasker:
        """This process's masker for the run (cached: every slice of the process shares it, and the
        pasted-prefix skeletons every process of the machine, in the work directory)."""
        skeletons = os.path.join(self.output.work_dir, SKELETONS)
        return cached_masker(self.tokenizer.build(), self.template, self.masking, skeletons)

    def masked_samples(self, conversations: list[Conversation]) -> list[TokenizedRow] | None:
        """The run's masker over ``conversations`` (a plan's sampled rows): what the plan estimates from
        before any work; ``None`` where there are none or the masker fails on one."""
        if not conversations:
            return None
        try:
            return self.masker().tokenize(conversations)
        except RenderError:
            return None

    def trainable_per_row(self, conversations: list[Conversation]) -> float | None:
        """The trainable tokens the run's masker gives each of ``conversations`` on average (none for a row
        it drops): what a trainable token budget's plan estimates from; ``None`` where the masker fails."""
        rows = self.masked_samples(conversations)
        if rows is None:
            return None
        return sum(int(r.mask.sum()) for r in rows if r.status == RowStatus.KEPT) / len(rows)


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
