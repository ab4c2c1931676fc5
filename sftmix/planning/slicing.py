"""The readers' cuts keyed into slices: each slice's key hashes what every slice shares (tokenizer,
template, the byte settings) with its rows and what they hold, so an identical rerun finds every slice
done. A cut made while a large file is still read is keyed at once and handed to the head start."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sftmix.sources.formats import MESSAGES_KEY
from sftmix.sources.reading import Cut, DatasetPlan, HandOn, Opened, Planning, Unfinished, digest, rows_key
from sftmix.tokenizing.slices import SliceSpec, TokenizeContext

logger = logging.getLogger(__name__)

#: What the plan hands each slice it cuts while a file is still being read (the head start's workers).
EarlySlice = Callable[[SliceSpec, TokenizeContext], None]


@dataclass
class Slicing:
    """The key every slice shares, the run's context, and the slices keyed so far (a cut handed to
    ``early`` is the same slice in the plan)."""

    shared_key: dict
    ctx: TokenizeContext
    early: EarlySlice | None = None
    _keyed: dict[int, tuple[Cut, SliceSpec]] = field(default_factory=dict)  # (by the cut, kept alive)

    def spec_of(self, dataset: Opened, cut: Cut) -> SliceSpec:
        """The slice of ``dataset`` that ``cut`` reads, keyed by its content (numbered later)."""
        if (known := self._keyed.get(id(cut))) is not None:
            return known[1]
        start, end, subset = cut.rows
        layout = (
            {}
            if (dataset.row_format, dataset.messages_key) == ("messages", MESSAGES_KEY)
            else {"row_format": [dataset.row_format, dataset.messages_key]}
        )
        entry = dataset.entry
        spec = SliceSpec(
            key=digest({**self.shared_key, **rows_key(start, end, subset), **layout, "data": cut.data}),
            index=-1,  # numbered once every dataset's slices are cut, in mixer order
            dataset_index=dataset.index,
            dataset=entry.path,
            split=entry.split,
            revision=entry.revision,
            row_format=dataset.row_format,
            messages_key=dataset.messages_key,
            row_start=start,
            row_end=end,
            rows=subset,
            est_bytes=cut.est_bytes,
            unrendered=dataset.probes,
            source=cut.source,
        )
        self._keyed[id(cut)] = (cut, spec)
        return spec

    def sample(self, dataset: Opened) -> SliceSpec:
        """The slice whose first rows are ``dataset``'s sample."""
        assert dataset.sampled is not None
        return self.spec_of(dataset, dataset.sampled)

    def cut(self, opened: list[Opened], at: Planning) -> tuple[list[DatasetPlan], list[SliceSpec]]:
        """Every dataset's slices, numbered in mixer order (a large file's first ones handed on to
        ``early`` while it is read)."""
        datasets: list[DatasetPlan] = []
        unfinished, first_index = Unfinished(), 0
        for dataset in opened:  # the slices, in mixer order (a large file's start while it is read)
            at.selected_total = sum(d.target for d in datasets)
            count = dataset.reader.cut(dataset, at, HandOn(self._deliver(dataset, first_index), unfinished))
            assert dataset.plan is not None
            first_index += count
            unfinished.check()
            datasets.append(dataset.plan)
        unfinished.finish()
        slices: list[SliceSpec] = []
        for dataset in opened:
            assert dataset.plan is not None
            specs = [self.spec_of(dataset, cut) for cut in dataset.cuts]
            for spec in specs:
                assert spec.index in (-1, len(slices))  # (one handed on early kept its number)
                spec.index = len(slices)
                slices.append(spec)
            dataset.plan.slices = [spec.index for spec in specs]
        return datasets, slices

    def _deliver(self, dataset: Opened, first_index: int) -> Callable[[Cut, int], bool] | None:
        """What hands ``dataset``'s ``k``-th cut, keyed and numbered, to ``early`` as it is made."""
        early = self.early
        if early is None:
            return None

        def deliver(cut: Cut, k: int) -> bool:
            spec = self.spec_of(dataset, cut)
            spec.index = first_index + k
            try:
                early(spec, self.ctx)
            except Exception as exc:  # (the flow runs the slice itself)
                logger.debug("no early start for %s: %s: %s", spec.describe(), type(exc).__name__, exc)
                return False
            return True

        return deliver
