"""End to end through the console script, with no Prefect server (the CLI starts a temporary API)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sftmix.runtime.stopping import RunStopped

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "tokenize_mixer.cli"]


def cli(
    *args: str, cwd: Path = ROOT, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The command in a process of its own; ``env`` adds to (and ``None`` values remove from) ours."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "PREFECT_API_URL" and v is not None}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    proc = subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow
def test_demo_runs_and_an_identical_rerun_reuses_everything(tmp_path):
    out, work = tmp_path / "demo", tmp_path / "work"
    first = cli("run", "examples/mixer.yaml", "--output_dir", str(out), "--work_dir", str(work))
    report = json.loads((out / "run_report.json").read_text())
    assert report["slices_computed"] == report["slices_total"] > 1
    assert {
        "slices_total",
        "slices_computed",
        "slices_reused",
        "rows_in",
        "rows_kept",
        "rows_dropped",
        "tokens",
        "trainable_tokens",
        "wall_seconds",
        "tokens_per_second",
    } <= set(report)
    assert "slices" in first.stdout
    # honest numbers: the whole command (start-up included) and a throughput over work done
    assert report["command_seconds"] > report["wall_seconds"] > report["tokenize_seconds"] > 0
    assert report["tokens_per_second"] > 0 and "start-up" in first.stdout
    # the plan is counted as planning, not as part of the tail (issue 26: a deployment's time line); the
    # command makes it while the API starts and hands it to the flow: part of the start-up, made once
    assert 0 <= report["plan_seconds"] < report["wall_seconds"] - report["tokenize_seconds"] + 1e-3
    assert report["plan_ahead_seconds"] > 0
    assert f"{report['plan_ahead_seconds']:.1f} s of it planning" in first.stdout
    assert "View at" not in first.stdout + first.stderr  # the temporary server is gone afterwards
    assert "PyTorch" not in first.stdout + first.stderr
    # a showcase: no warning in the run, and `check` at the demo's sequence length finds nothing
    assert " WARNING " not in first.stderr, first.stderr
    checked = cli("check", str(out), "--sequence_length", "512")
    assert (
        checked.returncode == 0 and "clean: nothing broken, nothing that changes training" in checked.stdout
    )
    digests = report["digests"]

    unchanged = cli("run", "examples/mixer.yaml", "--output_dir", str(out), "--work_dir", str(work))
    assert "up to date" in unchanged.stdout  # nothing rewritten (tests/test_up_to_date.py)
    rerun = cli("run", "examples/mixer.yaml", "--output_dir", str(out), "--work_dir", str(work), "--force")
    again = json.loads((out / "run_report.json").read_text())
    assert again["slices_reused"] == again["slices_total"] and again["slices_computed"] == 0
    assert again["tokens_per_second"] == 0 and "checking reused slices" in rerun.stdout
    assert again["digests"] == digests
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]

    plan = cli("plan", "examples/mixer.yaml", "--work_dir", str(work)).stdout
    assert "examples/data/general.jsonl" in plan and "slices" in plan
    # the size line estimates the output's tokens from the sampled rows: the run made within a tenth of it
    estimated = int(re.search(r"^size +~([\d,]+) tokens in 283 rows", plan, re.M).group(1).replace(",", ""))  # type: ignore[union-attr]
    made = json.loads((out / "run_report.json").read_text())["tokens"]
    assert abs(estimated - made) <= made / 10, (estimated, made)

    # one amount changed, into the same output: refused before any slice is tokenized, naming the change
    changed = tmp_path / "changed.yaml"
    changed.write_text((ROOT / "examples" / "mixer.yaml").read_text().replace("amount: 100 ", "amount: 50 "))
    slices_before = sorted(p.parent.name for p in work.glob("slices/*/*/manifest.json"))
    refused = cli("run", str(changed), "--output_dir", str(out), "--work_dir", str(work), check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "holds shards made with other settings or data" in refused.stderr
    assert (
        "mixer.datasets[2].amount: 100 -> 50" in refused.stderr and "Nothing was tokenized" in refused.stderr
    )
    assert "Traceback" not in refused.stderr
    # refused from the config alone, before a Prefect API starts (a flow run never exists), said once
    assert "Beginning flow run" not in refused.stderr and "Prefect API" not in refused.stderr
    assert [line for line in refused.stderr.splitlines() if "error" in line.lower()] == [
        next(line for line in refused.stderr.splitlines() if line.startswith("error: output directory"))
    ]
    assert sorted(p.parent.name for p in work.glob("slices/*/*/manifest.json")) == slices_before
    assert json.loads((out / "run_report.json").read_text())["digests"] == digests


@pytest.mark.parametrize(
    "dataset", ["examples/data/missing.jsonl", "someorg/nonexistent-dataset-xyz"], ids=["missing", "hub"]
)
def test_an_input_that_cannot_be_opened_is_refused_before_the_flow_starts(tmp_path, dataset):
    """A missing data file, or a hub name with no hub to ask: one error line naming the dataset once,
    exit 2, no flow run begun and nothing tokenized or written."""
    config = tmp_path / "mixer.yaml"
    config.write_text(
        (ROOT / "examples" / "mixer.yaml").read_text().replace("examples/data/general.jsonl", dataset)
    )
    out, work = tmp_path / "out", tmp_path / "work"
    proc = cli(
        "run", str(config), "--output_dir", str(out), "--work_dir", str(work), check=False,
        env={"HF_ENDPOINT": "https://no-such-host.invalid", "HF_HUB_OFFLINE": None},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    [error] = [line for line in output.splitlines() if "error" in line.lower()]
    assert error.startswith(f"error: dataset {dataset!r}: ") and error.count(dataset) == 1, error
    assert ("no such local file" if dataset.endswith(".jsonl") else "cannot be reached") in error
    assert "Beginning flow run" not in output and "Traceback" not in output
    assert not list(work.glob("slices/*/*/manifest.json")) and not out.exists()


@pytest.mark.parametrize("what", ["dataset", "tokenizer"])
def test_offline_a_hub_name_no_cache_holds_is_refused_at_once(tmp_path, what):
    """Under HF_HUB_OFFLINE (common on clusters) a mistyped hub name is refused before a Prefect API starts,
    naming the caches looked in; a name a cache holds passes that check."""
    home = tmp_path / "hf"
    (home / "hub" / "datasets--someorg--cached-one").mkdir(parents=True)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "HF_HUB_CACHE": None, "HF_DATASETS_CACHE": None}
    dataset = "someorg/typo-of-a-name" if what == "dataset" else "examples/data/general.jsonl"
    tokenizer = "someorg/typo-of-a-tokenizer" if what == "tokenizer" else "examples/tokenizer"
    args = [
        "convert", "--dataset_mixer_list", dataset, "1.0", "--tokenizer_name_or_path", tokenizer,
        "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w"),
    ]  # fmt: skip
    proc = cli(*args, check=False, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "HF_HUB_OFFLINE is set while no local cache holds it" in proc.stderr
        and f"a typo, or a {what} not downloaded" in proc.stderr
        and str(home / "hub") in proc.stderr
    )
    assert "Prefect API" not in proc.stderr and "Traceback" not in proc.stderr
    from sftmix.sources.hub import offline_cache_problem

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_HOME", str(home))
        patch.delenv("HF_HUB_CACHE", raising=False)
        patch.delenv("HF_DATASETS_CACHE", raising=False)
        assert offline_cache_problem("SomeOrg/Cached-One", "dataset") is None  # any case
        assert offline_cache_problem("someorg/other", "dataset", [str(tmp_path)]) is not None
        (tmp_path / "someorg___other").mkdir()  # prepared by `datasets` in the run's cache
        assert offline_cache_problem("someorg/other", "dataset", [str(tmp_path)]) is None
        patch.delenv("HF_HUB_OFFLINE")
        assert offline_cache_problem("someorg/typo", "model") is None  # online: the hub answers


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_unknown_template_name_can_be_an_error_before_anything_starts(tmp_path, how):
    """convert falls back to the tokenizer's own template on an unknown name, as the reference does;
    ``--unknown_template error`` (or the environment setting) refuses it instead, with the close names,
    before a Prefect API starts or the tokenizer loads."""
    args = [
        "convert", "--dataset_mixer_list", "examples/data/general.jsonl", "1.0",
        "--tokenizer_name_or_path", "examples/tokenizer", "--chat_template_name", "olmo2",
        "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w"),
    ]  # fmt: skip
    if how == "flag":
        proc = cli(*args, "--unknown_template", "error", check=False)
    else:
        proc = cli(*args, check=False, env={"TOKENIZE_MIXER_UNKNOWN_TEMPLATE": "error"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unknown chat template 'olmo2'; did you mean 'olmo' or 'olmo_old'?" in proc.stderr
    assert "Prefect API" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    typo = cli(*args, check=False, env={"TOKENIZE_MIXER_UNKNOWN_TEMPLATE": "erorr"})
    assert typo.returncode == 2 and "TOKENIZE_MIXER_UNKNOWN_TEMPLATE must be fallback or error" in typo.stderr


@pytest.mark.slow
def test_convert_validates_against_the_reference_and_compare_locates_a_difference(golden_dir, tmp_path):
    case = next(
        c for c in json.loads((golden_dir / "cases.json").read_text())["cases"] if c["name"] == "tulu_amounts"
    )
    expected = golden_dir / "expected" / "tulu_amounts"
    out = tmp_path / "out"
    cli(
        "convert",
        *case["args"],
        "--output_dir",
        str(out),
        "--work_dir",
        str(tmp_path / "work"),
        "--reference",
        str(expected),
        cwd=golden_dir,
    )
    assert cli("compare", str(out), str(expected)).returncode == 0

    digests = tmp_path / "digests.json"
    said = cli("digest", str(out), "-o", str(digests)).stdout
    assert said.startswith(f"wrote the digests of {out} (") and said.rstrip().endswith(f"files) to {digests}")
    assert cli("compare", str(out), str(digests)).returncode == 0

    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    tokens = np.fromfile(tampered / "token_ids_part_0000.npy", dtype=np.uint32)
    tokens[500] += 1
    tokens.tofile(tampered / "token_ids_part_0000.npy")
    proc = cli("compare", str(tampered), str(out), check=False)
    assert proc.returncode == 1
    assert "DIFF   token_ids_part_0000.npy" in proc.stdout
    assert f"offset {500 * 4}" in proc.stdout and "token 500 of part 0" in proc.stdout
    assert "outputs DIFFER in tokens; masks and boundaries are identical" in proc.stdout
    assert "dataset 'data/" in proc.stdout and "row" in proc.stdout

    renamed = tmp_path / "renamed"  # a dataset named otherwise: what a trainer reads is the same
    shutil.copytree(out, renamed)
    for name in ("dataset_statistics.json", "dataset_statistics.txt"):
        text = (renamed / name).read_text(encoding="utf-8")
        (renamed / name).write_text(text.replace(case["args"][1], "elsewhere.jsonl"), encoding="utf-8")
    proc = cli("compare", str(renamed), str(out), check=False)
    assert proc.returncode == 1
    assert proc.stdout.rstrip().endswith(
        "outputs DIFFER in statistics; tokens, masks and boundaries are identical"
    ), proc.stdout


def test_convert_accepts_hyphenated_flags_and_reports_errors_without_traceback(tmp_path):
    proc = cli(
        "convert",
        "--dataset-mixer-list",
        "missing.jsonl",
        "1.0",
        "--tokenizer-name-or-path",
        str(ROOT / "examples" / "tokenizer"),
        "--output-dir",
        str(tmp_path / "o"),
        "--work-dir",
        str(tmp_path / "w"),
        check=False,
    )
    assert proc.returncode == 2
    assert "error: dataset 'missing.jsonl': no such local file (relative to" in proc.stderr


@pytest.mark.slow
def test_two_runs_at_once_share_a_work_dir_without_corrupting_it(tmp_path):
    """Idempotent atomic slice writes: two runs that compute the same slices at the same time."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    work = tmp_path / "work"
    procs = [
        subprocess.Popen(
            [
                *CLI,
                "run",
                "examples/mixer.yaml",
                "--output_dir",
                str(tmp_path / f"out{i}"),
                "--work_dir",
                str(work),
                "--slice_rows",
                "16",
                "--runner",
                "thread",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    for i in range(2):
        assert cli("compare", str(tmp_path / f"out{i}"), "examples/demo.digests.json").returncode == 0
    third = cli(
        "run",
        "examples/mixer.yaml",
        "--output_dir",
        str(tmp_path / "out2"),
        "--work_dir",
        str(work),
        "--slice_rows",
        "16",
    )
    assert "0 computed" in third.stdout


def test_the_console_filter_passes_a_summary_line_through_prefects_run_logger_and_drops_it():
    """The marker survives Prefect's run-logger adapter (which merges extras), and the console's filter
    drops exactly the marked line and Prefect's state chatter."""
    import logging

    from prefect.logging.loggers import PrefectLogAdapter

    from sftmix.runtime.console import SUMMARY_LOG, QuietConsole

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    handler.addFilter(QuietConsole())
    base = logging.getLogger("prefect.flow_runs.console-test")
    base.addHandler(handler)
    base.propagate = False
    base.setLevel(logging.INFO)
    try:
        run_logger = PrefectLogAdapter(base, extra={"flow_run_name": "x"})
        run_logger.info("rows        2 in", extra=SUMMARY_LOG)
        run_logger.info("5 slices")
        logging.getLogger("EventsWorker.console-test").addHandler(handler)
        logging.getLogger("EventsWorker.console-test").warning("Still processing items: 3 items remaining...")
    finally:
        base.removeHandler(handler)
        logging.getLogger("EventsWorker.console-test").removeHandler(handler)
    assert seen == ["5 slices"]


@pytest.mark.slow
def test_a_run_says_each_thing_once_on_the_console(tmp_path):
    """No Prefect state line per task run and no event worker's flush notes (``--verbose`` shows them),
    from the command or from its worker processes; an unknown template name (convert) is warned about
    once, though the command plans it twice."""
    proc = cli(
        "run", "examples/mixer.yaml", "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w"),
        "--runner", "process", "--workers", "2",
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert "Finished in state" not in output and "Still processing items" not in output
    assert "Beginning flow run" in proc.stderr  # Prefect's own lines that say something stay
    assert "documents   283 in 1 part(s)" in proc.stdout
    verbose = cli(
        "-v", "convert", "--dataset_mixer_list", "examples/data/general.jsonl", "1.0",
        "--tokenizer_name_or_path", "examples/tokenizer", "--chat_template_name", "not_a_name",
        "--output_dir", str(tmp_path / "v"), "--work_dir", str(tmp_path / "w"),
    )  # fmt: skip
    assert "Finished in state" in verbose.stderr  # --verbose shows everything
    assert verbose.stderr.count("UNKNOWN CHAT TEMPLATE 'not_a_name'") == 1
    # the first thing said, before the API starts; the summary names the template used
    assert verbose.stderr.index("UNKNOWN CHAT TEMPLATE") < verbose.stderr.index("Prefect API")
    [line] = [x for x in verbose.stdout.splitlines() if x.startswith("template ")]
    assert (
        "tokenizer:examples/tokenizer (unknown name 'not_a_name')" in line and "the tokenizer's own" in line
    )


@pytest.mark.slow
def test_the_run_summary_is_printed_once(tmp_path):
    proc = cli(
        "run", "examples/mixer.yaml", "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w")
    )
    assert (proc.stdout + proc.stderr).count("documents   283 in 1 part(s)") == 1


def test_the_command_lines_conventions():
    """``--version``; ``-v`` after the subcommand as before it; no abbreviated flags; ``plan`` refuses the
    run flags it would ignore; every flag and positional a user can give says what it is."""
    import argparse

    from tokenize_mixer.cli import build_parser

    version = cli("--version")
    assert version.stdout.startswith("tokenize-mixer ") and version.stdout.split()[1][0].isdigit()
    parser = build_parser()
    assert parser.parse_args(["plan", "c.yaml", "-v"]).verbose is True
    assert parser.parse_args(["-v", "plan", "c.yaml"]).verbose is True
    assert parser.parse_args(["plan", "c.yaml"]).verbose is False
    for argv, wrong in (
        (["run", "examples/mixer.yaml", "--output", "x"], "--output"),  # a prefix of --output_dir
        (["plan", "examples/mixer.yaml", "--force"], "--force"),
        (["plan", "examples/mixer.yaml", "--check", "strict"], "--check"),
        (["plan", "examples/mixer.yaml", "--reference", "x"], "--reference"),
    ):
        refused = cli(*argv, check=False)
        assert refused.returncode == 2 and f"unrecognized arguments: {wrong}" in refused.stderr, argv

    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.help is None and not isinstance(action, argparse._HelpAction):
                silent.append(f"{name} {action.option_strings or action.dest}")
    assert not silent, silent


@pytest.mark.slow
def test_a_published_report_says_when(tmp_path):
    """``published_at`` is the publish's time, the output marker's and the report's alike."""
    from sftmix.output.output_dir import OUTPUT_MARKER

    out = tmp_path / "out"
    cli("run", "examples/mixer.yaml", "--output_dir", str(out), "--work_dir", str(tmp_path / "w"))
    report = json.loads((out / "run_report.json").read_text())
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert report["published_at"] and report["published_at"] == marker["published_at"]


def _on_a_terminal(*args: str, columns: int = 120) -> tuple[int, str]:
    """The command with stdin, stdout and stderr on a pseudo-terminal (as a person runs it): its exit code
    and what the terminal received, escape sequences removed."""
    import pty
    import select

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS=str(columns), LINES="40", TERM="xterm")
    proc = subprocess.Popen(
        [*CLI, *args], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, start_new_session=True
    )
    os.close(slave)
    received = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the terminal's last reader is gone (Linux)
                    break
                if not data:
                    break
                received += data
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
    code = proc.wait(timeout=600)
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", received.decode("utf-8", "replace"))


@pytest.mark.slow
def test_log_lines_print_above_the_bar_never_glued_to_it(tmp_path):
    """On a terminal the live bar owns its line: every log line starts a line of its own."""
    code, screen = _on_a_terminal(
        "run", "examples/mixer.yaml", "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w")
    )
    assert code == 0, screen[-3000:]
    assert "━" in screen and "Beginning flow run" in screen  # the bar, and log lines while it shows
    glued = []
    for line in re.split(r"[\r\n]", screen):
        found = re.search(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) ", line)
        if found and line[: found.start()].strip():
            glued.append(line)
    assert not glued, glued


@pytest.mark.slow
def test_strict_refuses_with_the_exit_code_check_gives_and_names_rows(tmp_path):
    """``--check strict`` exits as ``check`` would for the same findings (1: changes training), its
    example the dataset's row (nothing was published, so no document number)."""
    data = tmp_path / "chats.jsonl"
    chats = [("q?", "fine."), ("q2?", "a <|endoftext|> b")]
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            + "\n"
            for q, a in chats
        )
    )
    convert = [
        "convert", "--dataset_mixer_list", str(data), "1.0", "--tokenizer_name_or_path", "examples/tokenizer",
        "--chat_template_name", "olmo", "--work_dir", str(tmp_path / "w"),
    ]  # fmt: skip
    strict = cli(*convert, "--output_dir", str(tmp_path / "strict"), "--check", "strict", check=False)
    assert strict.returncode == 1, strict.stderr[-3000:]
    assert f"(e.g. {data} row 1)" in strict.stderr and not (tmp_path / "strict").exists()
    cli(*convert, "--output_dir", str(tmp_path / "out"))
    assert cli("check", str(tmp_path / "out"), check=False).returncode == 1


@pytest.mark.parametrize(
    ("stop", "raised"),
    [
        (KeyboardInterrupt, KeyboardInterrupt),
        (lambda: RunStopped("stopped by SIGTERM", 143), RunStopped),
        (lambda: MemoryError("no room"), MemoryError),
    ],
    ids=["ctrl-c", "our-stop", "another-error"],
)
def test_a_stop_inside_main_called_in_process_reaches_the_caller_whose_process_goes_on(
    tmp_path, monkeypatch, stop, raised
):
    """Only the command's own process ends with a stop's one line (``exit_now``, which also kills the
    process's children): a caller of ``main`` in its own process (a test runner's worker, a notebook)
    gets the exception and its own signal handlers back."""
    from sftmix.runtime.processes import STOP_SIGNALS
    from tokenize_mixer import cli as command

    theirs = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    hook = sys.unraisablehook

    def stopped(*args, **kwargs):
        raise stop()

    monkeypatch.setattr(command, "run_flow", stopped)
    with pytest.raises(raised):
        command.main(["run", str(ROOT / "examples" / "mixer.yaml"), "--work_dir", str(tmp_path)])
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == theirs
    assert sys.unraisablehook is hook


def test_main_called_from_another_thread_answers_as_from_the_main_one(tmp_path):
    """Signal handlers are the main thread's to set: a call from another thread (a notebook's worker, a
    server's handler) leaves them alone and gets its answer."""
    import threading

    from tokenize_mixer.cli import main

    answers: list[object] = []

    def call() -> None:
        try:
            answers.append(main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]))
        except BaseException as exc:  # (the test's own answer: what reached the thread)
            answers.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(60)
    assert answers and isinstance(answers[0], int), answers
