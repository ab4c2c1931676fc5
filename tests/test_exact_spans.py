"""``spans: exact`` (opt-in, beyond the reference): where the template pastes message texts, each
assistant turn's span starts at its content and covers no other message's text, for all 21 of the
reference's templates; rows the reference rule drops are kept and counted."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.labels import assistant_indices
from sftmix.tokenizing.prefix_renders import PrefixRenders
from sftmix.tokenizing.row_status import RowStatus
from sftmix.tokenizing.templates import NAMED_TEMPLATES, ChatRenderer, named_template
from tests.test_labels import masker
from tests.tiers import examples

SPECIALS = {"eos_token": "<|endoftext|>", "bos_token": "<|bos|>"}
FILLERS = ["", " ", "\n", " padded ", "<think>why</think>", "\n\nmore text."]


def chat_of(turns: list[tuple[str, str]]) -> Conversation:
    """Each message's text is unique (a numbered word plus filler), so where it lands is unambiguous."""
    return Conversation(
        [{"role": role, "content": f"{filler}w{i}q{filler}"} for i, (role, filler) in enumerate(turns)], None
    )


turns = st.lists(
    st.tuples(st.sampled_from(["user", "assistant", "system"]), st.sampled_from(FILLERS)),
    min_size=1,
    max_size=7,
)


@pytest.mark.parametrize("name", NAMED_TEMPLATES)
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=turns)
def test_exact_spans_start_at_the_content_and_cover_no_other_message(name, turns):
    conv = chat_of(turns)
    renderer = ChatRenderer(named_template(name), SPECIALS)
    try:
        full = renderer.render(conv.messages, None, False)
    except Exception:
        return
    indices = assistant_indices(conv.messages)
    spans = PrefixRenders(renderer.render).content_spans(conv, full, indices)
    if spans is None:
        return  # not pasted: the reference rule is used
    for idx, (start, end) in zip(indices, spans, strict=True):
        content = conv.messages[idx]["content"]
        text = full[start:end]
        assert text.startswith(content) or text.startswith(content.strip()), (name, idx, text[:60])
        for other in range(len(conv.messages)):
            if other != idx:
                assert f"w{other}q" not in text, (name, idx, other, text)


def test_exact_spans_keep_rows_the_reference_rule_drops_and_count_them():
    """olmo on a multi-turn chat the reference rule cannot verify: exact spans keep it, and its mask is
    the assistant texts (with their end-of-turn), never the user's."""
    conv = Conversation(
        [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Tell me a joke"},
            {"role": "assistant", "content": "Why did the chicken cross the road?"},
        ],
        None,
    )
    reference = masker("dolma2", "olmo", None, fast=True)
    exact = masker("dolma2", "olmo", None, fast=True)
    exact.spans = "exact"
    ref_row = reference.tokenize([conv])[0]
    row = exact.tokenize([conv])[0]
    assert np.array_equal(row.ids, ref_row.ids)
    assert row.status == RowStatus.KEPT and row.mask.any()
    decoded = exact.decode(row.ids[row.mask.astype(bool)].tolist())
    assert "Hi! How can I help?" in decoded and "Why did the chicken cross the road?" in decoded
    assert "Hello" not in decoded and "joke" not in decoded and "assistant" not in decoded
    assert row.reference_drops == (ref_row.status != RowStatus.KEPT)


def test_the_flow_keeps_and_reports_rows_with_exact_spans(golden_dir, prefect_api, tmp_path, monkeypatch):
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

    monkeypatch.chdir(golden_dir)

    def run(spans: str) -> dict:
        mixer = MixerConfig.model_validate(
            {
                "datasets": [{"path": "data/chat_think.jsonl", "amount": "1.0"}],
                "tokenizer": {"name_or_path": "tokenizers/dolma2", "chat_template": "olmo_thinker"},
                "spans": spans,
                "output": {"path": str(tmp_path / spans)},
            }
        )
        return tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work"), runner="thread"))

    reference, exact = run("reference"), run("exact")
    assert exact["rows_kept"] > reference["rows_kept"]
    assert exact["rows_kept_by_exact_spans"] == exact["rows_kept"] - reference["rows_kept"]
    assert reference["rows_kept_by_exact_spans"] == 0
    # the summary names the reason in words, its share, that the reference drops them too and the way out
    from sftmix.output.report import RunReport

    summary = RunReport.model_validate(reference).render()
    dropped = reference["rows_dropped"]["assistant_span_unverified"]
    share = 100 * dropped / reference["rows_in"]
    assert f"  data/chat_think.jsonl: {reference['rows_in']:,} in, {reference['rows_kept']:,} kept" in summary
    assert f"    {dropped:,} ({share:.1f}%) assistant_span_unverified: the reference's check" in summary
    assert "the reference drops these too, and `spans: exact` keeps them" in summary
