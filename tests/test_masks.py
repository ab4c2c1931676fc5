"""Mask modes: assistant (the reference's), last_turn, all; and a template that masks nothing is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import TemplateError
from sftmix.planning.plan import build_plan
from tests.slice_rows import tokenized_rows

TINY = Path(__file__).parent / "golden" / "tokenizers" / "tiny"


def chat(n: int, turns: int) -> dict:
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {n}.{t}"})
        msgs.append({"role": "assistant", "content": f"answer {n}.{t}"})
    return {"messages": msgs}


def rows_of(
    tmp_path: Path, rows: list[dict], mask: str, template: str, mask_thinking: bool = False
) -> list[tuple[np.ndarray, np.ndarray]]:
    data = tmp_path / f"d-{mask}-{Path(template).stem}-{mask_thinking}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(data))],
        tokenizer=TokenizerSpec(name_or_path=str(TINY), chat_template=template),
        max_seq_length=None,
        mask=mask,
        mask_thinking=mask_thinking,
        output=OutputSpec(path=str(tmp_path / "out")),
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))
    return [(tokens, mask) for _, tokens, mask in tokenized_rows(plan) if tokens is not None]


def decode(ids: np.ndarray) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY / "tokenizer.json")).decode(ids.tolist(), skip_special_tokens=False)


@pytest.mark.parametrize("template", ["tulu", "olmo"])
def test_mask_modes(tmp_path, template):
    rows = [chat(n, turns) for n, turns in enumerate([1, 3, 2, 4])]
    assistant = rows_of(tmp_path, rows, "assistant", template)
    last = rows_of(tmp_path, rows, "last_turn", template)
    everything = rows_of(tmp_path, rows, "all", template)
    assert len(assistant) == len(last) == len(everything) == 4
    for (ta, ma), (tl, ml), (te, me), row in zip(assistant, last, everything, rows, strict=True):
        assert np.array_equal(ta, tl) and np.array_equal(ta, te)  # masks differ, tokens never do
        assert me.all()
        assert not (ml & ~ma).any()  # last_turn is a part of the assistant mask
        final = row["messages"][-1]["content"]
        assert final in decode(ta[ml.astype(bool)])
        for earlier in row["messages"][1:-1:2]:
            assert earlier["content"] not in decode(ta[ml.astype(bool)])
        if len(row["messages"]) == 2:
            assert np.array_equal(ma, ml)


def test_a_template_that_masks_nothing_is_refused(tmp_path):
    silent = tmp_path / "users_only.jinja"
    silent.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(
        TemplateError, match=r"all 40 rows have an all-zero label mask with template file:.*users_only"
    ):
        rows_of(tmp_path, [chat(n, 1) for n in range(40)], "assistant", str(silent))


TULU_WITH_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)


def test_generation_tags_mark_what_the_template_says(tmp_path):
    """The tulu template with its assistant text inside {% generation %}: the same bytes, and the
    generation mask equals the reference's assistant mask."""
    marked = tmp_path / "tulu_generation.jinja"
    marked.write_text(TULU_WITH_GENERATION)
    rows = [chat(n, turns) for n, turns in enumerate([1, 3, 2])]
    reference = rows_of(tmp_path, rows, "assistant", "tulu")
    tagged = rows_of(tmp_path, rows, "generation_tags", str(marked))
    for (ta, ma), (tg, mg) in zip(reference, tagged, strict=True):
        assert np.array_equal(ta, tg)
        assert np.array_equal(ma, mg)
    with pytest.raises(TemplateError, match="mask generation_tags needs a template .* tokenize-mixer:tulu"):
        rows_of(tmp_path, rows, "generation_tags", "tulu")


def test_generation_mask_is_transformers_return_assistant_tokens_mask(tmp_path):
    """The same mask transformers computes for a {% generation %} template, row by row."""
    from transformers import AutoTokenizer

    rows = [chat(n, turns) for n, turns in enumerate([1, 3, 2, 4])]
    rows.append(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  spaced  out  "}]}
    )
    marked = tmp_path / "tulu_generation.jinja"
    marked.write_text(TULU_WITH_GENERATION)
    ours = rows_of(tmp_path, rows, "generation_tags", str(marked))
    tok = AutoTokenizer.from_pretrained(TINY)
    theirs = []
    for row in rows:
        out = tok.apply_chat_template(
            row["messages"], chat_template=TULU_WITH_GENERATION, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        if any(out["assistant_masks"]):  # a row with nothing to learn is dropped (and counted) by us
            theirs.append((list(out["input_ids"]), list(out["assistant_masks"])))
    assert [(ids.tolist(), mask.tolist()) for ids, mask in ours] == theirs
    assert len(theirs) >= len(rows) - 1


@pytest.mark.parametrize("template", ["olmo", "tulu"])
def test_mask_thinking_trains_the_answers_and_not_the_thinking(tmp_path, template):
    """Through the config: with mask_thinking the thinking of every assistant turn is out of the mask and
    its answer in; with mask: last_turn too, only the final answer is trained on (final_answer_only)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": "question one"},
                {"role": "assistant", "content": "<think>reason r1z</think>answer a1z"},
                {"role": "user", "content": "question two"},
                {"role": "assistant", "content": "<think>reason r2z</think>answer a2z"},
            ]
        }
    ]
    [(tokens, plain)] = rows_of(tmp_path, rows, "assistant", template)
    [(same, thinking)] = rows_of(tmp_path, rows, "assistant", template, mask_thinking=True)
    [(_, final)] = rows_of(tmp_path, rows, "last_turn", template, mask_thinking=True)
    assert np.array_equal(tokens, same)
    trained = decode(tokens[thinking.astype(bool)])
    assert "r1z" in decode(tokens[plain.astype(bool)]) and "r1z" not in trained and "r2z" not in trained
    assert "a1z" in trained and "a2z" in trained and "think>" not in trained
    assert "a2z" in decode(tokens[final.astype(bool)]) and "a1z" not in decode(tokens[final.astype(bool)])
