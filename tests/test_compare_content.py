"""``compare`` reads two OLMo-core outputs as a trainer does: layout told from content, and where contents
differ, the first differing document named in each output, with whether it is the same source row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sftmix.output.digest import compare
from tests.cli_runs import convert_args
from tests.test_over_length import MAX_LEN, _rows


def test_layout_is_told_from_content(prefect_api, tmp_path):
    from tokenize_mixer.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))

    def convert(name: str, *extra: str) -> Path:
        out = tmp_path / name
        args = convert_args(
            data, tmp_path / "work", out, "--slice_rows", "16", *extra, max_seq_length=MAX_LEN
        )
        assert main(args) == 0
        return out

    reference = convert("reference")
    small = ["--part_bytes", "4096"]
    cut = convert("cut", *small)  # the reference's layout, documents cut at parts' ends
    whole = convert("whole", "--parts", "whole_documents", *small)
    for other in (cut, whole):
        result = compare(reference, other)
        assert not result.matches  # (the files differ: the exit code of a difference)
        last = result.render().splitlines()[-1]
        parts = len(list(other.glob("token_ids_part_*.npy")))
        assert last == f"same documents, tokens and masks; part layout differs: 1 part vs {parts} parts", last
        assert "first differing byte" not in result.render()
    assert compare(cut, whole).render().splitlines()[-1].startswith("same documents, tokens and masks")
    broken = (
        tmp_path / "broken"
    )  # a part's boundaries gone, another's damaged: compared as files, no traceback
    shutil.copytree(whole, broken)
    (broken / "token_ids_part_0001.csv.gz").unlink()
    assert "ONLY_A token_ids_part_0001.csv.gz" in compare(whole, broken).render()
    shutil.copytree(whole, broken, dirs_exist_ok=True)
    (broken / "token_ids_part_0001.csv.gz").write_bytes(b"not gzip")
    said = compare(reference, broken).render()
    assert "not read across parts: BadGzipFile" in said and "ONLY_B token_ids_part_0001.csv.gz" in said

    terminated = convert(
        "terminated", "--parts", "whole_documents", *small, "--over_length_strategy", "terminate"
    )
    said = compare(whole, terminated).render().splitlines()  # the same parts: offsets in them mean something
    assert said[-1] == "outputs DIFFER in tokens; masks and boundaries are identical", said[-1]
    assert said[-2].endswith("(the same source row)") and "dataset" in said[-2]
    said = compare(reference, terminated).render().splitlines()
    parts = len(list(terminated.glob("token_ids_part_*.npy")))
    assert said[-1] == (
        f"outputs DIFFER in tokens (documents and masks the same) and in part layout: 1 part vs {parts} parts"
    ), said[-1]

    dropped = convert("dropped", "--over_length_strategy", "drop", "--lineage")
    said = compare(reference, dropped).render().splitlines()
    assert said[-2].startswith("first differing token ") and said[-2].endswith("(other source rows)"), said[
        -2
    ]
    assert said[-2].count("dataset '") == 2
    bare = tmp_path / "bare"  # no run report (so no document map): the lineage columns name the row
    shutil.copytree(dropped, bare)
    (bare / "run_report.json").unlink()
    line = compare(reference, bare).render().splitlines()[-2]
    assert f"in the second the document from token 0: dataset '{data}', row " in line, line
