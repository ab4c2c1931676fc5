"""The short report every run ends with: printed, and written as ``run_report.json``."""

from __future__ import annotations

from pydantic import BaseModel, Field


class DatasetReport(BaseModel):
    name: str
    selected: int
    kept: int
    dropped: dict[str, int]


class Validation(BaseModel):
    reference: str
    matches: bool
    details: str


class RunReport(BaseModel):
    output_dir: str
    publish: str = ""
    slices_total: int
    slices_computed: int
    slices_reused: int
    slices_rechecked: int = Field(
        0, description="Cached slices whose files failed their digest and were recomputed."
    )
    rows_in: int
    rows_kept: int
    rows_dropped: dict[str, int]
    datasets: list[str]
    per_dataset: list[DatasetReport]
    documents: int
    rows_kept_by_exact_spans: int = Field(
        0, description="Source rows kept with spans: exact that the reference's span rule would have dropped."
    )
    untrainable_documents: int = Field(
        0, description="Documents with no trainable token, kept because drop_untrainable is off."
    )
    tokens: int
    trainable_tokens: int
    parts: int
    token_dtype: str
    wall_seconds: float
    tokenize_seconds: float
    tokens_per_second: float
    steady_seconds: float = Field(
        0.0, description="First slice start to last slice end, over the slices computed in this run."
    )
    steady_tokens_per_second: float = Field(
        0.0, description="Tokens of the slices computed / steady_seconds."
    )
    digests: dict[str, str]
    drop_examples: list[dict] = Field(
        default_factory=list, description="Up to 20 dropped or skipped rows: dataset, row, reason, detail."
    )
    validation: Validation | None = None
    documents_file: str
    warnings: list[str] = Field(default_factory=list)

    def render(self) -> str:
        dropped = ", ".join(f"{k} {v}" for k, v in self.rows_dropped.items()) or "none"
        lines = [
            f"output      {self.output_dir} ({self.publish})",
            f"slices      {self.slices_total} total: {self.slices_computed} computed, {self.slices_reused} reused"
            + (f", {self.slices_rechecked} recomputed after a failed check" if self.slices_rechecked else ""),
            f"rows        {self.rows_in} in, {self.rows_kept} kept"
            + (
                f" ({self.untrainable_documents} with no trainable token)"
                if self.untrainable_documents
                else ""
            )
            + f", dropped: {dropped}",
            f"documents   {self.documents} in {self.parts} part(s), {self.tokens:,} tokens "
            f"({self.trainable_tokens:,} trainable), dtype {self.token_dtype}",
            f"time        {self.wall_seconds:.1f} s wall, {self.tokens_per_second:,.0f} tokens/s",
        ]
        if self.validation is not None:
            verdict = "MATCHES" if self.validation.matches else "DIFFERS"
            lines.append(f"reference   {self.validation.reference}: {verdict}")
        return "\n".join(lines)
