"""Bad input (issue 11, item 5): an empty file, a directory, a compressed or unknown file, a path that
does not exist, an absurd amount and a malformed row each give one line naming the file and what to do,
through the real code paths (``datasets``, the tokenizer fixtures, ``tokenize-mixer plan``)."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import logging
import lzma
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sftmix.errors
import sftmix.planning.plan
from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.config.selection import ASSEMBLE_BYTES_PER_ROW, MAX_SELECTED_ROWS
from sftmix.errors import BadRowError, DatasetError
from sftmix.planning.plan import build_plan
from sftmix.sources.jsonl import JsonlSource
from sftmix.tokenizing.slices import load_slice_arrays, tokenize_slice
from tokenize_mixer.cli import main

TINY = Path(__file__).parent / "golden" / "tokenizers" / "tiny"
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def mixer(tmp_path: Path, *datasets: tuple[str, object]) -> MixerConfig:
    return MixerConfig(
        datasets=[DatasetEntry(path=p, amount=a) for p, a in datasets],
        tokenizer=TokenizerSpec(name_or_path=str(TINY), chat_template="tulu"),
        max_seq_length=128,
        output=OutputSpec(path=str(tmp_path / "out")),
    )


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }
    for i in range(6)
]
BAD = {"messages": [{"role": None, "content": "x"}]}


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Run from tmp_path, so datasets are named by relative paths as users type them."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def plan_cli(here: Path, capsys, *datasets: tuple[str, object]) -> tuple[int, str, str]:
    """``tokenize-mixer plan`` on a config of ``datasets``: exit code, stdout, stderr (with what was
    logged at ERROR or with a traceback, which pytest's log capture would otherwise keep to itself)."""
    lines = ["datasets:"]
    for path, amount in datasets:
        lines += [f"  - path: {json.dumps(path)}", f"    amount: {amount!r}"]
    lines += [
        f"tokenizer: {{name_or_path: {json.dumps(str(TINY))}, chat_template: tulu}}",
        "max_seq_length: 128",
        "output: {path: out}",
    ]
    (here / "mixer.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    handler = _Loud()
    logging.getLogger().addHandler(handler)
    try:
        code = main(["plan", "mixer.yaml", "--work_dir", str(here / "work")])
    finally:
        logging.getLogger().removeHandler(handler)
    out, err = capsys.readouterr()
    return code, out, "".join(handler.lines) + err


class _Loud(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(logging.Formatter().format(record) + "\n")


def one_error_line(code: int, err: str) -> str:
    """The CLI's answer to an error the user can act on: exit 2 and a single ``error:`` line."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if a name reaches ``datasets.load_dataset`` as a hub name."""
    import datasets

    real = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path not in ("json", "parquet"):
            raise AssertionError(f"{path!r} was looked up as a hub dataset")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


# 1. empty files


def test_an_empty_file_is_an_error_naming_it(here, capsys, no_hub):
    (here / "empty.jsonl").write_bytes(b"")
    line = one_error_line(*plan_cli(here, capsys, ("empty.jsonl", 1.0))[::2])
    assert line == (
        "error: dataset 'empty.jsonl': the file is empty (0 bytes); remove it from the mixer or give it rows"
    )


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("blank.jsonl", b"\n  \n\t\n", "the file has no rows, only blank lines"),
        ("blank.jsonl.gz", gzip.compress(b"\n\n", mtime=0), "the file has no rows, only blank lines"),
        ("nothing.jsonl.gz", gzip.compress(b"", mtime=0), "the file decompresses to nothing (0 bytes)"),
        ("array.json", b"[]\n", "the file has no rows (an empty JSON array, or only empty objects)"),
        ("objects.jsonl", b"{}\n{}\n", "the file has no rows (an empty JSON array, or only empty objects)"),
        ("empty.parquet", b"", "the file is empty (0 bytes)"),
    ],
)
def test_files_without_rows_say_so(here, capsys, name, content, reason):
    (here / name).write_bytes(content)
    line = one_error_line(*plan_cli(here, capsys, (name, 1.0))[::2])
    assert line == f"error: dataset {name!r}: {reason}; remove it from the mixer or give it rows"


def test_a_parquet_file_without_rows_says_so(here, capsys):
    pq.write_table(
        pa.table({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string())])))}), "none.parquet"
    )
    line = one_error_line(*plan_cli(here, capsys, ("none.parquet", 1.0))[::2])
    assert line == (
        "error: dataset 'none.parquet': the file has no rows; remove it from the mixer or give it rows"
    )


def test_the_console_script_prints_one_line_for_an_empty_file(tmp_path):
    """The same through ``python -m tokenize_mixer.cli``, as a user sees it (it printed five tracebacks)."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "mixer.yaml").write_text(
        "datasets: [{path: empty.jsonl}]\n"
        f"tokenizer: {{name_or_path: {json.dumps(str(TINY))}, chat_template: tulu}}\n"
        "output: {path: out}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenize_mixer.cli",
            "plan",
            "mixer.yaml",
            "--work_dir",
            str(tmp_path / "work"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        "error: dataset 'empty.jsonl': the file is empty (0 bytes); remove it from the mixer or give it rows\n",
    )


# 2. a directory with a data file's name


def test_a_directory_named_like_a_data_file(here, capsys, no_hub):
    (here / "x.jsonl").mkdir()
    line = one_error_line(*plan_cli(here, capsys, ("x.jsonl", 1.0))[::2])
    assert line.startswith(
        "error: dataset 'x.jsonl': is a directory, not a file: name the data file inside it"
    )


# 3. compressed files, other formats, local paths that do not exist


COMPRESSORS = {
    "d.jsonl.gz": gzip.compress,
    "d.json.gz": gzip.compress,
    "d.jsonl.bz2": bz2.compress,
    "d.jsonl.xz": lzma.compress,
    "D.JSONL.GZ": gzip.compress,
}


def test_compressed_json_gives_the_tokens_of_the_plain_file(here):
    """Decompressed to a copy that is read by batch as the plain file is (sftmix.sources.jsonl): the same tokens
    and masks, and the same checkpoints (the same rows, the same keys) for every codec and the plain
    file."""
    plain = write_jsonl(here / "d.jsonl", ROWS)
    raw = (here / "d.jsonl").read_bytes()

    def slices(path: str, work: str):
        plan = build_plan(mixer(here, (path, 1.0)), RunOptions(work_dir=str(here / work), slice_rows=4))
        assert all(
            not getattr(s.source, "arrow_files", None) and isinstance(s.source, JsonlSource)
            for s in plan.slices
        )
        manifests = [tokenize_slice(s, plan.context) for s in plan.slices]
        arrays = [load_slice_arrays(plan.context.output.work_dir, m)[:2] for m in manifests]
        return [s.key for s in plan.slices], arrays

    keys, expected = slices(plain, "w-plain")
    assert len(keys) == 2
    for i, (name, compress) in enumerate(COMPRESSORS.items()):
        (here / name).write_bytes(compress(raw))
        got_keys, got = slices(name, f"w{i}")
        assert got_keys == keys, name
        for (tokens, mask), (want_tokens, want_mask) in zip(got, expected, strict=True):
            assert np.array_equal(tokens, want_tokens) and np.array_equal(mask, want_mask), name


def test_invalid_utf8_inside_a_compressed_file_names_the_line(here):
    (here / "latin1.jsonl.gz").write_bytes(
        gzip.compress(
            json.dumps(GOOD).encode()
            + b"\n"
            + '{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1")
        )
    )
    with pytest.raises(DatasetError, match=r"latin1\.jsonl\.gz:2: not valid UTF-8"):
        build_plan(mixer(here, ("latin1.jsonl.gz", 1.0)), RunOptions(work_dir=str(here / "w")))


def test_zstd_without_its_package_is_refused_by_name(here, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "zstandard" else real(name, *a),
    )
    (here / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd not really zstd")
    line = one_error_line(*plan_cli(here, capsys, ("d.jsonl.zst", 1.0))[::2])
    assert line == (
        "error: dataset 'd.jsonl.zst': reading .zst files needs the 'zstandard' package "
        "(pip install zstandard), or decompress the file first"
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("d.csv", "not a data file we read: we read .jsonl, .json or .parquet"),
        ("d.parquet.gz", "a compressed parquet file is not read: decompress it"),
        ("d.zip", "an archive is not read: extract the data file and name it"),
        ("d.ndjson", "not a data file we read: JSON Lines must end in .jsonl (rename it)"),
        ("notes", "not a data file we read"),  # an existing file without a suffix is not a hub name
    ],
)
def test_files_we_do_not_read_are_refused_at_once(here, capsys, no_hub, name, reason):
    (here / name).write_bytes(b"a,b\n1,2\n")
    line = one_error_line(*plan_cli(here, capsys, (name, 1.0))[::2])
    assert line.startswith(f"error: dataset {name!r}: {reason}")


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("nope.jsonl", "file"),
        ("nope.jsonl.gz", "file"),
        ("data/nope.parquet", "file"),
        ("nope.csv", "file"),
        ("./nope", "file or directory"),
        ("../nope", "file or directory"),
        ("a/b/c", "file or directory"),  # hub ids have at most one '/'
    ],
)
def test_a_missing_local_path_never_reaches_the_hub(here, capsys, no_hub, name, what):
    started = time.monotonic()
    line = one_error_line(*plan_cli(here, capsys, (name, 1.0))[::2])
    assert time.monotonic() - started < 10  # no hub retries
    assert line == (
        f"error: dataset {name!r}: no such local {what} (relative to the current directory {os.getcwd()})"
    )


def test_a_missing_absolute_path_needs_no_directory_note(here, capsys, no_hub):
    missing = str(here / "gone.jsonl")
    line = one_error_line(*plan_cli(here, capsys, (missing, 1.0))[::2])
    assert line == f"error: dataset {missing!r}: no such local file"


# 4. absurd amounts


@pytest.mark.parametrize(
    ("amount", "selected"), [(100_000_000_000, "100,000,000,000"), (100_000_000_000.0, "600,000,000,000")]
)
def test_an_absurd_amount_is_refused_before_allocating(here, capsys, amount, selected):
    write_jsonl(here / "d.jsonl", ROWS)
    line = one_error_line(*plan_cli(here, capsys, ("d.jsonl", amount))[::2])
    assert line.startswith(
        f"error: dataset 'd.jsonl': amount {amount} selects {selected} rows from its 6 (each row "
    )
    assert f"a mixer may select at most {MAX_SELECTED_ROWS:,} rows (2**31 - 1" in line
    assert line.endswith("give a smaller amount (1.0 = every row once, 3.0 = upsample 3x, 1000 = 1000 rows)")


def test_the_bound_counts_the_whole_mixer(here, capsys, monkeypatch):
    monkeypatch.setattr(sftmix.planning.plan, "memory_limit", lambda: None)  # the fixed bound alone
    write_jsonl(here / "a.jsonl", ROWS)
    write_jsonl(here / "b.jsonl", ROWS)
    line = one_error_line(*plan_cli(here, capsys, ("a.jsonl", 2**30), ("b.jsonl", 2**30))[::2])
    assert line.startswith(
        "error: dataset 'b.jsonl': amount 1073741824 selects 1,073,741,824 rows from its 6"
    )
    assert "2,147,483,648 in the whole mixer: a mixer may select at most 2,147,483,647 rows" in line


def test_a_selection_that_cannot_be_assembled_in_memory_is_refused(here, capsys, monkeypatch):
    monkeypatch.setattr(sftmix.planning.plan, "memory_limit", lambda: 2**30)
    write_jsonl(here / "d.jsonl", ROWS)
    rows = 2**30 // ASSEMBLE_BYTES_PER_ROW + 1
    line = one_error_line(*plan_cli(here, capsys, ("d.jsonl", rows))[::2])
    assert f"amount {rows} selects {rows:,} rows from its 6" in line
    assert f"keeps about {ASSEMBLE_BYTES_PER_ROW} bytes per selected row in memory, 1.0 GiB here, " in line
    assert "more than this machine's 1.0 GiB; give a smaller amount" in line
    code, out, err = plan_cli(here, capsys, ("d.jsonl", rows - 1))  # just below: planned
    assert code == 0 and f"{rows - 1:>9}" in out, err


# 5. row numbers


def bad_row_error(here: Path, path: str) -> BadRowError:
    """The error for the file's bad row: the plan's, where its sample holds the row, else its slice's."""
    with pytest.raises(BadRowError) as exc:
        plan = build_plan(mixer(here, (path, 1.0)), RunOptions(work_dir=str(here / f"w-{Path(path).name}")))
        for spec in plan.slices:
            tokenize_slice(spec, plan.context)
    return exc.value


def test_a_bad_row_of_a_jsonl_file_names_its_line(here):
    """Rows count from 0, lines from 1, and blank lines (skipped by the loader) shift them apart."""
    text = (
        "".join(json.dumps(r) + "\n" for r in ROWS[:2])
        + "\n\n"
        + json.dumps(BAD)
        + "\n"
        + json.dumps(GOOD)
        + "\n"
    )
    (here / "d.jsonl").write_text(text, encoding="utf-8")
    exc = bad_row_error(here, "d.jsonl")
    assert str(exc).startswith(
        "dataset 'd.jsonl', row 2 (0-based; line 5 of the file): message 0 has no 'role' string"
    )
    assert (exc.row, exc.line) == (2, 5)
    again = pickle.loads(pickle.dumps(exc))  # crosses worker processes whole
    assert (type(again), str(again), again.line) == (BadRowError, str(exc), 5)

    (here / "d.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert "row 2 (0-based; line 5 of the file)" in str(bad_row_error(here, "d.jsonl.gz"))


def test_a_bad_row_without_lines_says_rows_count_from_zero(here):
    pq.write_table(
        pa.Table.from_pylist([GOOD, GOOD, GOOD, {"messages": [{"role": "user", "content": None}]}]),
        "d.parquet",
    )
    exc = bad_row_error(here, "d.parquet")
    assert str(exc).startswith("dataset 'd.parquet', row 3 (0-based): ") and exc.line is None
    (here / "d.json").write_text(json.dumps([GOOD, BAD, GOOD], indent=1), encoding="utf-8")  # a JSON array
    assert str(bad_row_error(here, "d.json")).startswith(
        "dataset 'd.json', row 1 (0-based): message 0 has no 'role' string"
    )
    assert str(BadRowError("d", 1, "bad")) == "dataset 'd', row 1 (0-based): bad"


def test_a_hub_shaped_name_with_no_hub_says_both_at_once(tmp_path, monkeypatch):
    """`examples/tokenizer` run from another directory: not a local directory here, and (as on this
    offline machine, or with HF_ENDPOINT pointing nowhere) no hub to ask: one line at once, not a
    minute of retries."""
    from sftmix.errors import ConfigError
    from sftmix.sources import hub
    from sftmix.tokenizing.tokenizer import TokenizerKey, load_hf_tokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://no-such-host.invalid")
    hub._hub_host_problem.cache_clear()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError) as err:
            load_hf_tokenizer(TokenizerKey.of("examples/tokenizer", None))
    finally:
        hub._hub_host_problem.cache_clear()
    assert time.monotonic() - started < 10
    assert str(err.value).startswith(
        f"tokenizer 'examples/tokenizer' is not a local directory (relative to the current directory {tmp_path})"
    )
    assert "no-such-host.invalid" in str(err.value) and "cannot be reached" in str(err.value)


def test_a_hub_dataset_name_with_no_hub_is_named_once(tmp_path, monkeypatch):
    """The dataset's error names it once: ``dataset 'x': is not a local directory ...``."""
    from sftmix.sources import hub
    from sftmix.sources.whole.arrow import describe

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://no-such-host.invalid")
    hub._hub_host_problem.cache_clear()
    try:
        with pytest.raises(DatasetError) as err:
            describe("someorg/nonexistent-dataset-xyz", "train", None, str(tmp_path / "cache"))
    finally:
        hub._hub_host_problem.cache_clear()
    message = str(err.value)
    assert message.startswith("dataset 'someorg/nonexistent-dataset-xyz': is not a local directory (relative")
    assert message.count("nonexistent-dataset-xyz") == 1 and "no-such-host.invalid" in message


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": {"name_or_path": "no/such/tokenizer/dir"}},
        {"tokenizer": {"chat_template": "no_such_template.jinja"}},
        {"datasets": [{"path": "no_such_data.jsonl", "amount": "1.0"}]},
    ],
    ids=["tokenizer", "template", "dataset"],
)
def test_the_commands_first_check_says_what_the_plan_would_say(tmp_path, monkeypatch, change):
    """``check_inputs`` (before the command starts a Prefect API) refuses what the plan refuses, in the
    same words: the same code says it."""
    from sftmix.planning.plan import check_inputs

    monkeypatch.chdir(tmp_path)
    examples = Path(__file__).parent.parent / "examples"
    (tmp_path / "d.jsonl").write_bytes((examples / "data" / "general.jsonl").read_bytes())
    config = {
        "datasets": [{"path": "d.jsonl", "amount": "1.0"}],
        "tokenizer": {"name_or_path": str(examples / "tokenizer"), "chat_template": "olmo"},
        "output": {"path": str(tmp_path / "out")},
    }
    config = {**config, **{k: {**config[k], **v} if isinstance(v, dict) else v for k, v in change.items()}}
    mixer = MixerConfig.model_validate(config)
    with pytest.raises(sftmix.errors.MixerError) as first:
        check_inputs(mixer)
    with pytest.raises(sftmix.errors.MixerError) as planned:
        build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))
    assert (type(first.value), str(first.value)) == (type(planned.value), str(planned.value))


#: A template that refuses a system turn, as Gemma's own does.
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
)


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_a_template_that_fails_on_a_sampled_row_is_refused_before_work(here, caplog, on_bad_row):
    """Every slice would start and the first with such a row fail (``on_bad_row: error``): the plan renders
    its sample rows and refuses, naming the row and its line, before any slice. With ``skip`` it says how many
    of the sample will be dropped, and the plan goes on."""
    (here / "t.jinja").write_text(NO_SYSTEM, encoding="utf-8")
    system = {"messages": [{"role": "system", "content": "be brief"}, *GOOD["messages"]]}
    write_jsonl(here / "d.jsonl", [*ROWS[:3], system, *ROWS[3:]])
    config = mixer(here, ("d.jsonl", 1.0)).model_copy(update={"on_bad_row": on_bad_row})
    config.tokenizer = TokenizerSpec(name_or_path=str(TINY), chat_template_file=str(here / "t.jinja"))
    options = RunOptions(work_dir=str(here / "work"))
    if on_bad_row == "error":
        with pytest.raises(BadRowError) as refused:
            build_plan(config, options)
        assert str(refused.value) == (
            "dataset 'd.jsonl', row 3 (0-based; line 4 of the file): chat template failed: TemplateError: System "
            "role not supported (refused before any work; on_bad_row: skip drops such rows)"
        )
        assert not (here / "work" / "slices").exists()
        return
    with caplog.at_level(logging.WARNING):
        plan = build_plan(config, options)
    said = "d.jsonl: the chat template fails on 1 of 7 sampled rows (row 3: chat template failed: TemplateError: "
    assert any(w.startswith(said) for w in plan.warnings) and said in caplog.text
