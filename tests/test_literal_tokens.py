"""``literal_special_tokens``: special tokens spelled in the rows read as the tokens (keep), as text
(split) or skipped (drop). The oracle for split is the tokenizers library itself: the render cut at the
template's own special tokens, each piece encoded with ``encode_special_tokens`` (the rows' spelled
tokens as text), the template's tokens between them by their ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from sftmix.check.findings import check_output
from sftmix.errors import MixerError
from sftmix.tokenizing.literal_tokens import renaming
from sftmix.tokenizing.templates import ChatRenderer, named_template
from tests.test_check import EXAMPLES, chat, run

SPELLED = [
    chat("say <|im_start|>user and <|endoftext|> now", "ok <|im_end|> done <|im_start|>assistant more"),
    {
        "messages": [
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "q3 <|im_end|>"},
            {"role": "assistant", "content": "a3 <|im_start|>x<|pad|>"},
        ]
    },
]
PLAIN = [chat(f"question {i}?", f"answer {i}.") for i in range(6)]


def _documents(out: Path) -> dict[int, np.ndarray]:
    """Each source row's tokens in the output."""
    report = json.loads((out / "run_report.json").read_text())
    docs = np.load(report["documents_file"])
    tokens = np.fromfile(out / "token_ids_part_0000.npy", dtype=np.dtype(report["token_dtype"]))
    return {int(d["row"]): tokens[d["start"] : d["start"] + d["length"]] for d in docs}


def _oracle(rows: list[dict], template: str) -> dict[int, list[int]]:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(EXAMPLES / "tokenizer"))
    rust = Tokenizer.from_file(str(EXAMPLES / "tokenizer" / "tokenizer.json"))
    variables = {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    text = named_template(template)
    specials = [t.content for t in hf.added_tokens_decoder.values() if t.special]
    names = renaming(text, variables, specials)
    original, renamed = (
        ChatRenderer(text, variables),
        ChatRenderer(names.template(text), names.variables(variables)),
    )
    by_name = {v: k for k, v in names.names.items()}
    cut = re.compile("|".join(map(re.escape, by_name)))
    rust.encode_special_tokens = True
    out = {}
    for i, row in enumerate(rows):
        seen = renamed.render(row["messages"], None, False)
        assert names.restore(seen) == original.render(row["messages"], None, False)
        ids, at = [], 0
        for m in cut.finditer(seen):
            ids += rust.encode(seen[at : m.start()], add_special_tokens=False).ids if m.start() > at else []
            ids.append(rust.token_to_id(by_name[m.group(0)]))
            at = m.end()
        ids += rust.encode(seen[at:], add_special_tokens=False).ids if at < len(seen) else []
        out[i] = ids
    return out


@pytest.mark.parametrize("template", ["tulu", pytest.param("olmo", marks=pytest.mark.full)])
@pytest.mark.parametrize("encoder", ["auto", pytest.param("hf", marks=pytest.mark.full)])
def test_split_reads_spelled_tokens_as_text_and_the_templates_as_tokens(
    prefect_api, tmp_path, template, encoder
):
    rows = [PLAIN[0], *SPELLED, *PLAIN[1:]]
    tok = {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": template, "encoder": encoder}
    keep = run(tmp_path, rows, "keep", template=template, tokenizer=tok)
    split = run(
        tmp_path, rows, "split", template=template, tokenizer={**tok, "literal_special_tokens": "split"}
    )
    kept, mine = _documents(keep), _documents(split)
    assert set(mine) == set(range(len(rows)))
    for i in (0, 3, 4, 5, 6, 7):  # no spelled token: the reference's bytes
        assert mine[i].tolist() == kept[i].tolist()
    oracle = _oracle(rows, template)
    for i in (1, 2):
        assert mine[i].tolist() == oracle[i][:4096]
        assert mine[i].tolist() != kept[i].tolist()
    findings = check_output(split, 4096).findings
    assert not [f for f in findings if "train special token" in f.what]  # split trains their text
    assert [(f.what, f.count, f.severity) for f in findings if "spell" in f.what] == [
        (
            "rows that spell a special token, read as plain text (literal_special_tokens: split)",
            2,
            "information",
        )
    ]
    report = json.loads((split / "run_report.json").read_text())
    assert report["literal"] == {"mode": "split", "spelled_rows": 2}
    trained = [f for f in check_output(keep, 4096).findings if "train special token" in f.what]
    assert trained and all("literal_special_tokens split reads it as text" in f.what for f in trained)


def test_drop_skips_rows_that_spell_a_special_token_and_counts_them(prefect_api, tmp_path):
    tok = {
        "name_or_path": str(EXAMPLES / "tokenizer"),
        "chat_template": "olmo",
        "literal_special_tokens": "drop",
    }
    out = run(tmp_path, [*SPELLED, *PLAIN], "drop", tokenizer=tok)
    report = json.loads((out / "run_report.json").read_text())
    assert report["rows_dropped"] == {"literal_special_token": 2}
    assert set(_documents(out)) == {2, 3, 4, 5, 6, 7}
    assert any("<|im_" in str(e.get("detail")) for e in report["drop_examples"])


def test_split_refuses_a_row_holding_a_character_it_gives_the_templates_tokens(prefect_api, tmp_path):
    """Such a row would read as the template's own token: an error naming the row, or a counted skip."""
    tok = {
        "name_or_path": str(EXAMPLES / "tokenizer"),
        "chat_template": "olmo",
        "literal_special_tokens": "split",
    }
    rows = [*PLAIN, chat("a \U00100001 here", "b")]
    with pytest.raises(MixerError, match=r"row 6.*U\+100001"):
        run(tmp_path, rows, "refused", tokenizer=tok)
    out = run(tmp_path, rows, "skipped", tokenizer=tok, on_bad_row="skip")
    assert json.loads((out / "run_report.json").read_text())["rows_dropped"] == {"bad_row": 1}


def test_the_setting_changes_the_recipe_only_when_it_is_not_the_references():
    from sftmix.config.config import MixerConfig
    from sftmix.planning.recipe import mixer_recipe

    def recipe(mode: str) -> dict:
        mixer = MixerConfig.model_validate(
            {
                "datasets": [{"path": "x.jsonl", "amount": "1.0"}],
                "tokenizer": {"name_or_path": "t", "chat_template": "olmo", "literal_special_tokens": mode},
                "output": {"path": "out"},
            }
        )
        return mixer_recipe(mixer)["tokenizer"]

    assert "literal_special_tokens" not in recipe("keep")  # recipes written before the setting still match
    assert recipe("split")["literal_special_tokens"] == "split"


def test_the_check_reads_how_a_run_read_spelled_tokens_from_old_and_new_reports():
    """A run report written before ``literal`` kept its two fields at the top: the check reads both."""
    from sftmix.tokenizing.literal_tokens import LiteralReport

    old = {"literal_special_tokens": "split", "rows_spelling_special_tokens": 3}
    new = {"literal": {"mode": "split", "spelled_rows": 3}}
    assert (
        LiteralReport.of_report(old)
        == LiteralReport.of_report(new)
        == LiteralReport(mode="split", spelled_rows=3)
    )
    assert LiteralReport.of_report({}) == LiteralReport()
    assert LiteralReport.of_report(new).lines(0) == [
        "literal     3 kept row(s) spell a special token, read as text (literal_special_tokens: split)"
    ]
