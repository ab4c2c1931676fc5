"""Lines of a JSON Lines file that are not rows: named FILE:LINE before any work, or skipped and counted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import BadLineError
from sftmix.planning.plan import build_plan
from sftmix.sources import jsonl
from sftmix.sources.jsonl import batches as jsonl_batches
from sftmix.tokenizing.slices import tokenize_slice
from tests.test_bad_input import TINY, here, one_error_line, plan_cli  # noqa: F401 (here: a fixture)

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

#: kind -> (the line, what the error says of it)
KINDS: dict[str, tuple[bytes, str]] = {
    "not JSON": (
        b'{"messages": [{"role": "user" "content": "x"}]}',
        r"not valid JSON \(Expecting ',' delimiter, column 31\) \(.*\"user\" \"content\".*\)",
    ),
    "cut short": (b'{"messages": [{"role": "user", "content": "hi"}', r"not valid JSON \(Expecting"),
    "an array": (b"[1, 2]", r"not a JSON object but an array \(\[1, 2\]\)"),
    "a string": (b'"hello"', r"not a JSON object but a string"),
    "a lone surrogate": (
        b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}',
        r"a string holds a lone surrogate .* \(.*a \\ud800 b",
    ),
    "invalid UTF-8": (
        '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"),
        r"not valid UTF-8 \(byte \d+ of the file\)",
    ),
    "a field of another type": (
        b'{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
        r"field '/messages/\[\]/content' holds a number here and strings in the rows before it",
    ),
}


def _write(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def _good(i: int) -> bytes:
    row = json.loads(json.dumps(GOOD))
    row["messages"][0]["content"] = f"hi {i}"
    return json.dumps(row).encode()


def _mixer(tmp_path: Path, path: str, on_bad_row: str) -> MixerConfig:
    return MixerConfig(
        datasets=[DatasetEntry(path=path, amount=1.0)],
        tokenizer=TokenizerSpec(name_or_path=str(TINY), chat_template="tulu"),
        max_seq_length=128,
        output=OutputSpec(path=str(tmp_path / "out")),
        on_bad_row=on_bad_row,
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_line_is_refused_by_the_plan_naming_file_and_line(here, capsys, kind):  # noqa: F811
    line, says = KINDS[kind]
    _write(here / "bad.jsonl", [_good(0), _good(1), line, _good(3)])
    code, _, err = plan_cli(here, capsys, ("bad.jsonl", 1.0))
    error = one_error_line(code, err)  # one line: no library log lines before it
    assert error.startswith("error: bad.jsonl:3: "), error
    assert re.search(says, error), error
    assert error.endswith("with on_bad_row skip, such lines are skipped and counted"), error


def test_a_large_files_bad_lines_are_named_by_line_alone_in_the_skip_warning(tmp_path):
    """A file cut into slices as its batches are counted (larger than a batch) says which of its own lines
    it skips, as a small one does; only a directory's one file names the file (``jsonl.lines_of``)."""
    padding = b'"' + b"x" * 2000 + b'"'
    lines = [
        _good(i)[:-1] + b', "pad": ' + padding + b"}" for i in range(jsonl_batches.BATCH_BYTES // 2000 + 500)
    ]
    lines[3000] = b"not json"
    path = _write(tmp_path / "large.jsonl", lines)
    assert Path(path).stat().st_size > jsonl_batches.BATCH_BYTES
    plan = build_plan(_mixer(tmp_path, path, "skip"), RunOptions(work_dir=str(tmp_path / "work")))
    assert len(plan.slices) > 1
    assert any("(line 3001)" in w and "will be skipped" in w for w in plan.warnings), plan.warnings


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_line_is_skipped_and_counted_with_skip(tmp_path, kind):
    line, says = KINDS[kind]
    path = _write(tmp_path / "bad.jsonl", [_good(0), _good(1), line, _good(3), b"", _good(4)])
    plan = build_plan(_mixer(tmp_path, path, "skip"), RunOptions(work_dir=str(tmp_path / "work")))
    assert (
        plan.datasets[0].n_rows == 5
    )  # every line that is not blank is a row: the rows after keep their numbers
    assert any("line 3" in w and "will be skipped" for w in plan.warnings), plan.warnings
    manifests = [tokenize_slice(spec, plan.context) for spec in plan.slices]
    assert sum(m.kept for m in manifests) == 4
    assert sum(m.dropped.get("bad_row", 0) for m in manifests) == 1
    (example,) = [e for m in manifests for e in m.findings.drop_examples]
    assert example["row"] == 2 and example["detail"].startswith("line 3: "), example
    assert re.search(says, example["detail"]), example


def test_bad_lines_past_the_first_batch_are_found_by_their_slice(tmp_path):
    """Lines that look like objects are parsed only by the slice that reads them: it names them (or
    skips them) as the plan would; the other rows of the batch are what datasets reads."""
    lines = [_good(i) for i in range(jsonl_batches.BATCH_BYTES // len(_good(0)) + 5000)]
    wrong_type = len(lines) - 100
    not_json = len(lines) - 7
    lines[wrong_type] = KINDS["a field of another type"][0]
    lines[not_json] = b'{"messages": [}'
    path = _write(tmp_path / "big.jsonl", lines)
    layout = jsonl.scan(path)
    assert layout is not None and len(layout.batches) == 2 and layout.bad_lines == ()
    last = layout.batches[-1]
    rows = list(range(last.first_row, last.first_row + last.rows))
    got = jsonl.read_rows(layout.source([last]), rows)
    bad = {r: g for r, g in zip(rows, got, strict=True) if isinstance(g, jsonl.BadLine)}
    assert sorted(bad) == [wrong_type, not_json]
    assert bad[wrong_type].line == wrong_type + 1 and "holds a number here" in bad[wrong_type].reason
    assert bad[not_json].line == not_json + 1 and bad[not_json].reason.startswith("not valid JSON")
    assert got[not_json - last.first_row + 1] == json.loads(lines[not_json + 1])
    error = bad[wrong_type].error(path)
    assert isinstance(error, BadLineError)
    assert str(error).startswith(f"{path}:{wrong_type + 1}: field '/messages/[]/content' holds a number")
