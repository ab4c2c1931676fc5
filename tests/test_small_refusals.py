"""What a new user hit, each refused or said before work: a part size that would cut every document or
make more parts than four-digit names sort, a mistyped key (with the closest setting), and a small input
given too few slices to share among the workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sftmix.config.config import MixerConfig
from sftmix.config.run_file import load_run_file
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError
from sftmix.output.olmo_format import MAX_PARTS, part_bytes_problem
from sftmix.planning.plan import build_plan

EXAMPLES = Path(__file__).parent.parent / "examples"


def _demo(tmp_path: Path, **output: object) -> MixerConfig:
    data = yaml.safe_load((EXAMPLES / "mixer.yaml").read_text())["mixer"]
    data["output"] = {"path": str(tmp_path / "out"), **output}
    return MixerConfig.model_validate(data)


def test_a_part_size_below_one_document_or_past_10000_parts_is_refused_with_the_numbers(tmp_path):
    run = RunOptions(work_dir=str(tmp_path / "work"))
    with pytest.raises(ConfigError, match=r"part_bytes 8 holds 4 token ids \(uint16\), fewer than one document "
                       r"of max_seq_length 512: give at least 1,024"):  # fmt: skip
        build_plan(_demo(tmp_path, part_bytes=8), run)
    unlimited = _demo(tmp_path, part_bytes=8).model_copy(update={"max_seq_length": None})
    with pytest.raises(
        ConfigError, match=r"into ~[\d,]+ parts, past the 10,000 that four-digit part names hold"
    ):
        build_plan(unlimited, run)
    assert build_plan(_demo(tmp_path, part_bytes=1024), run) is not None
    assert part_bytes_problem(2, "uint16", None, MAX_PARTS) is None  # (0000 to 9999)
    assert part_bytes_problem(2, "uint16", None, MAX_PARTS + 1) is not None
    assert part_bytes_problem(8, "uint16", 2, 3 * MAX_PARTS) is None  # 4 tokens a part: 7,500 parts
    assert part_bytes_problem(8, "uint16", 2, 3 * MAX_PARTS + 3, whole=True) is not None  # each may hold 3


def test_a_mistyped_key_names_the_closest_setting_at_every_level(tmp_path):
    config = {
        "mixr": {},
        "mixer": {
            "datasets": [{"path": "a.jsonl", "amout": "3.0"}],
            "tokenizer": {"name_or_path": "t", "chat_templat": "olmo"},
            "max_seq_lenght": 512,
            "output": {"path": "o", "partbytes": 100},
        },
        "run": {"slice_row": 64, "zzz": 1},
    }
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        load_run_file(path)
    said = str(caught.value).splitlines()
    for line in (
        "  mixr: unknown setting; did you mean 'mixer'?",
        "  mixer.datasets.0.amout: unknown setting; did you mean 'amount'?",
        "  mixer.tokenizer.chat_templat: unknown setting; did you mean 'chat_template' or 'chat_template_file'?",
        "  mixer.max_seq_lenght: unknown setting; did you mean 'max_seq_length'?",
        "  mixer.output.partbytes: unknown setting; did you mean 'part_bytes' or 'parts'?",
        "  run.slice_row: unknown setting; did you mean 'slice_rows' or 'slice_bytes'?",
        "  run.zzz: unknown setting",
    ):
        assert line in said, said


@pytest.mark.parametrize("workers", [2, 8])
def test_a_file_of_a_few_mb_gives_every_worker_two_slices(tmp_path, workers):
    """Two 10 MiB batches were two slices whatever the workers: now a small mixture is cut finer, the
    same slices whether the file is cut as it is read (every row) or after a count (a subset)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i} " * 50},
                {"role": "assistant", "content": f"a{i} " * 300},
            ]
        }
        for i in range(2500)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert 3 << 20 < data.stat().st_size < 10 << 20  # one 10 MiB batch of datasets' JSON reader
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data)}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "output": {"path": str(tmp_path / "out")},
        }
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), workers=workers))
    assert len(plan.slices) >= 2 * workers
    assert sum(s.row_end - s.row_start for s in plan.slices) == len(rows)
