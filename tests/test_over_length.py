"""``over_length_strategy`` (open-instruct's flag, after the commit we follow): what a conversation cut at
``max_seq_length`` becomes. ``keep`` is the reference's bytes; ``terminate`` and ``drop`` are derived here
from the ``keep`` output row by row, with the truncation told by tokenizing each whole render apart."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.templates import ChatRenderer, named_template
from sftmix.tokenizing.tokenizer import TokenizerKey, load_hf_tokenizer, rust_tokenizer, special_tokens
from tests.test_labels import masker
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

EXAMPLES = Path(__file__).parent.parent / "examples"
TOKENIZERS = {
    "tiny": GOLDEN / "tokenizers" / "tiny",
    "dolma2": GOLDEN / "tokenizers" / "dolma2",
    "demo": EXAMPLES / "tokenizer",
}


def _two_turns() -> Conversation:
    return Conversation(
        messages=[
            {"role": "user", "content": "What is the capital of France? Please answer briefly."},
            {"role": "assistant", "content": "The capital of France is Paris, a city on the Seine."},
            {"role": "user", "content": "And what is the capital of Italy, which lies to the south east?"},
            {"role": "assistant", "content": "The capital of Italy is Rome, on the Tiber, in Lazio."},
        ],
        tools=None,
    )


def _masker(tokenizer: str, template: str, max_len: int | None, fast: bool):
    return masker(TOKENIZERS[tokenizer], template, max_len, fast=fast)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("template", ["olmo", "tulu"])
@pytest.mark.parametrize("tokenizer", list(TOKENIZERS))
def test_a_row_is_truncated_exactly_when_its_kept_tokens_do_not_cover_its_render(tokenizer, template, fast):
    """A render of exactly ``max_seq_length`` tokens is not truncated, one token more is; a cut right after
    an earlier turn's EOS still is; a cut in a later user turn ends on a token that is not trained on."""
    conv = _two_turns()
    whole = _masker(tokenizer, template, None, fast).tokenize([conv])[0]
    n = whole.ids.shape[0]
    assert not whole.truncated

    def at(max_len: int):
        row = _masker(tokenizer, template, max_len, fast).tokenize([conv])[0]
        assert np.array_equal(row.ids, whole.ids[:max_len])
        return row

    assert not at(n).truncated and at(n).ids.shape[0] == n
    assert at(n - 1).truncated and at(n - 1).mask[-1] == whole.mask[n - 2]
    eos = load_hf_tokenizer(TokenizerKey.of(str(TOKENIZERS[tokenizer]), None)).eos_token_id
    inside = np.flatnonzero(whole.ids[:-1] == eos)
    if inside.size:  # (tulu ends every assistant turn with EOS; olmo only the last)
        cut = at(int(inside[0]) + 1)
        assert cut.truncated and cut.ids[-1] == eos and cut.mask[-1] == 1
    first_end = int(np.flatnonzero(np.diff(whole.mask.astype(np.int8)) == -1)[0]) + 1
    later = first_end + 3  # a few tokens into the next turn's header: not trained on
    cut = at(later + 1)
    assert cut.truncated and cut.mask[-1] == 0 and cut.mask.any()


def _rows() -> list[dict]:
    """Single-turn chats of many lengths (cut in the answer, or fitting), and two-turn ones whose cut falls
    in the second user turn."""
    rows = []
    for i in range(60):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Question {i}: " + "tell me more. " * (i % 5)},
                    {"role": "assistant", "content": f"Answer {i}: " + "here is more. " * (i % 23)},
                ]
            }
        )
    for i in range(10):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Short {i}?"},
                    {"role": "assistant", "content": f"Short answer {i}."},
                    {"role": "user", "content": "A long follow-up question. " * 60},
                    {"role": "assistant", "content": "Fine."},
                ]
            }
        )
    return rows


MAX_LEN = 160


def _documents(out: Path, dtype: str) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """Each document by its source row (``--lineage``): its tokens, its mask, its place in the output."""
    tokens = np.fromfile(out / "token_ids_part_0000.npy", dtype=dtype)
    mask = np.fromfile(out / "labels_mask_part_0000.npy", dtype=np.uint8)
    found = {}
    lines = gzip.decompress((out / "token_ids_part_0000.csv.gz").read_bytes()).decode().split()
    for k, line in enumerate(lines):
        start, end, _, row = map(int, line.split(","))
        found[row] = (tokens[start:end], mask[start:end], k)
    return found


def _full_lengths(rows: list[dict], tokenizer: str = "demo", template: str = "olmo") -> list[int]:
    """Each row's whole render in tokens, as the reference's tokenizer makes it (no masker involved)."""
    key = TokenizerKey.of(str(TOKENIZERS[tokenizer]), None)
    renderer = ChatRenderer(named_template(template), special_tokens(load_hf_tokenizer(key)))
    texts = [renderer.render(r["messages"], None, False) for r in rows]
    return [len(e.ids) for e in rust_tokenizer(key).encode_batch(texts, add_special_tokens=False)]


@pytest.mark.parametrize(
    ("tokenizer", "template", "max_len"),
    [
        ("demo", "olmo", MAX_LEN),
        pytest.param("dolma2", "tulu", 64, marks=pytest.mark.full),
    ],  # (tulu: no system turn)
)
def test_terminate_and_drop_are_derived_from_keep_and_tokenize_nothing_again(
    prefect_api, tmp_path, capsys, tokenizer, template, max_len
):
    """Through ``convert``, as open-instruct's command line spells it: every row of ``terminate`` and ``drop``
    (with and without the filter step) is what the rule derives from ``keep``; switching reuses every slice;
    the summary says what became of the cut rows; with ``terminate`` the check finds only the rows cut in
    text not trained on."""
    from sftmix.output.report import RunReport
    from tests.cli_runs import convert_args
    from tokenize_mixer.cli import main
    from tokenize_mixer.flows.artifacts import report_markdown

    rows = _rows()
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = tmp_path / "work"
    if tokenizer == "dolma2":
        ensure_dolma2()
    eos = load_hf_tokenizer(TokenizerKey.of(str(TOKENIZERS[tokenizer]), None)).eos_token_id
    cut = {i for i, n in enumerate(_full_lengths(rows, tokenizer, template)) if n > max_len}
    assert 10 < len(cut) < len(rows) - 10

    def convert(name: str, *extra: str) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
        out = tmp_path / name
        args = convert_args(
            data, work, out, "--slice_rows", "16", "--lineage", *extra, max_seq_length=max_len
        )
        args[args.index("--tokenizer_name_or_path") + 1] = str(TOKENIZERS[tokenizer])
        args[args.index("--chat_template_name") + 1] = template
        assert main(args) == 0
        return _documents(out, json.loads((out / "run_report.json").read_text())["token_dtype"])

    keep = convert("keep")
    assert set(keep) == set(range(len(rows)))
    kept_said = capsys.readouterr().out

    terminated = convert("terminate", "--over_length_strategy", "terminate")
    said = capsys.readouterr().out
    assert "0 computed, 5 reused" in said
    ended = 0
    for row, (tokens, mask, place) in keep.items():
        expected = tokens.copy()
        if row in cut and mask[-1]:
            expected[-1] = eos
            ended += 1
        got = terminated[row]
        assert np.array_equal(got[0], expected) and np.array_equal(got[1], mask) and got[2] == place, row
    assert (
        f"{len(cut)} rows longer than max_seq_length {max_len}: {len(cut)} kept without EOS, {ended} of them "
        "cut in trained text" in kept_said
    )
    assert f"{ended} ended with a trainable EOS" in said
    assert f"{len(cut) - ended} kept without EOS (cut in text that is not trained on)" in said
    assert 0 < ended < len(cut)
    report = json.loads((tmp_path / "terminate" / "run_report.json").read_text())
    (truncation,) = [f for f in report["check_findings"] if "truncated at max_seq_length" in f["what"]]
    assert truncation["count"] == len(cut) - ended
    page = report_markdown(RunReport.model_validate(report))  # (the UI's run report)
    assert (
        f"| over length | {data}: {len(cut)} rows longer than max_seq_length {max_len}: {ended} ended" in page
    )

    dropped = convert("drop", "--over_length_strategy", "drop")
    assert "0 computed, 5 reused" in capsys.readouterr().out
    assert set(dropped) == set(keep) - cut
    for row, (tokens, mask, _) in dropped.items():
        assert np.array_equal(tokens, keep[row][0]) and np.array_equal(mask, keep[row][1])
    stats = json.loads((tmp_path / "drop" / "dataset_statistics.json").read_text())
    assert stats["per_dataset_statistics"][0]["instances_filtered_during_transformation"] == len(cut)

    chain = ["--dataset_transform_fn", "sft_tulu_tokenize_and_truncate_v1"]
    unfiltered = convert("keep-unfiltered", *chain)
    masked = convert("drop-unfiltered", *chain, "--over_length_strategy", "drop")
    assert set(masked) == set(unfiltered) == set(keep)
    for row, (tokens, mask, place) in unfiltered.items():
        got = masked[row]
        assert np.array_equal(got[0], tokens) and got[2] == place
        assert not got[1].any() if row in cut else np.array_equal(got[1], mask)
