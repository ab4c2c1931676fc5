"""The warm runner (sftmix/warm.py, flows/warm_runner.py): a cold command leaves one; later commands with
the same key run in it, with the same bytes, lines and exit codes, stopped by real signals to the
command, a killed command, a closed pipe or a dead API; it leaves by itself after its idle time."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sftmix import warm
from sftmix.digest import compare
from tests.cli_runs import assert_rerun_resumes, cli_env, launch_warm_runner
from tests.soak import alive, children, runners_in

ROOT = Path(__file__).parent.parent
TOOL = Path(sys.executable).parent / "tokenize-mixer"
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402

#: Seconds a stop may take, from the signal to the exit of the command (as tests/test_stopping.py).
STOP_WITHIN = 10.0
WARM_LINE = "in the warm runner"
COLD_LINE = "starting a temporary Prefect API server"


def convert(data: Path, work: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(TOOL), "convert", "--dataset_mixer_list", str(data), "1.0",
        "--tokenizer_name_or_path", str(ROOT / "examples" / "tokenizer"), "--chat_template_name", "olmo",
        "--max_seq_length", "256", "--work_dir", str(work), "--output_dir", str(out), "--slice_rows", "500",
        "--runner", "process", "--workers", "2", *extra,
    ]  # fmt: skip


@dataclass
class Warm:
    root: Path
    env: dict[str, str]
    data: Path
    expected: Path
    key: str = ""

    @property
    def directory(self) -> Path:
        return Path(self.env["XDG_RUNTIME_DIR"]) / f"tokenize-mixer-{os.getuid()}"

    def states(self) -> list[dict]:
        found = []
        for path in self.directory.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(path.read_text()))
        return found

    def state(self) -> dict:
        """The state of the fixture's runner (a test's other environment may have left another)."""
        return json.loads(warm.state_path(self.directory, self.key).read_text())

    def log(self) -> str:
        return "".join(p.read_text() for p in self.directory.glob("*.log"))


def _wait(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds:.0f} s: {what}"
        time.sleep(0.1)


def _runs_of(state: dict) -> list[int]:
    """The runner's forked runs (its children other than its API server)."""
    return [c for c in children(state["pid"]) if c != state["api_pid"]]


@pytest.fixture(scope="module")
def warm_runner(tmp_path_factory) -> Warm:
    """A cold run with warm runners asked for (not on a terminal: the setting asks), which leaves one."""
    root = tmp_path_factory.mktemp("warm")
    run_dir = Path(tempfile.mkdtemp(prefix="tm-warm-"))  # (pytest's paths are too long for a socket)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(11), 30_000)))
    env = {
        **cli_env(),
        "XDG_RUNTIME_DIR": str(run_dir),
        "PREFECT_HOME": str(root / "prefect"),
        warm.WARM_SECONDS_ENV: "300",
    }
    expected = root / "expected"
    cold = subprocess.run(
        convert(data, root / "work-cold", expected), env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert COLD_LINE in cold.stderr and "a warm runner (pid " in cold.stderr  # said where it is seen
    found = Warm(root, env, data, expected)
    _wait(lambda: any(found.directory.glob("*.sock")), 180, "a ready runner")
    (socket,) = found.directory.glob("*.sock")
    found.key = socket.stem
    yield found
    runners = runners_in(found.directory)  # ready or starting (another environment's included)
    for pid in runners:
        os.kill(pid, signal.SIGTERM)
    _wait(lambda: not any(alive(p) for p in runners), 30, "the runners' end")
    assert list(found.directory.glob("*.sock")) == []  # each took its socket away
    assert not [s for s in found.states() if alive(s["api_pid"])]
    shutil.rmtree(run_dir, ignore_errors=True)


class Command:
    """The command as a shell job (a process group of its own), its stderr read as it comes."""

    def __init__(self, cmd: list[str], env: dict[str, str], stdout=subprocess.PIPE) -> None:
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, start_new_session=True, stdout=stdout, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, seconds: float = 120) -> None:
        _wait(lambda: text in self.text() or self.proc.poll() is not None, seconds, repr(text))
        assert text in self.text(), self.text()[-3000:]

    def ended(self, seconds: float = STOP_WITHIN) -> int:
        code = self.proc.wait(seconds)
        time.sleep(0.2)  # the reader's last lines
        return code


@pytest.mark.slow
def test_a_later_command_runs_in_the_warm_runner_with_the_same_bytes(warm_runner, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        convert(warm_runner.data, tmp_path / "work", out), env=warm_runner.env, cwd=ROOT, capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert WARM_LINE in done.stderr and COLD_LINE not in done.stderr
    assert compare(out, warm_runner.expected).matches
    assert "slices      " in done.stdout  # the summary on the command's own stdout
    assert not _runs_of(warm_runner.state())  # its run ended with it


@pytest.mark.slow
def test_a_refusal_in_the_warm_runner_is_the_same_line_and_exit_code(warm_runner, tmp_path):
    missing = tmp_path / "missing.jsonl"
    cmd = convert(missing, tmp_path / "work", tmp_path / "out")
    in_runner = subprocess.run(cmd, env=warm_runner.env, cwd=ROOT, capture_output=True, text=True)
    cold = subprocess.run(
        cmd, env={**warm_runner.env, warm.WARM_SECONDS_ENV: "0"}, cwd=ROOT, capture_output=True, text=True
    )
    assert in_runner.returncode == cold.returncode == 2
    assert in_runner.stderr == cold.stderr and str(missing) in in_runner.stderr
    assert f"--output_dir {tmp_path / 'out'}" in warm_runner.log()  # it was the runner's run


@pytest.mark.slow
def test_another_environment_or_warm_runners_off_run_cold(warm_runner, tmp_path):
    for index, extra in enumerate(({"SOME_SETTING": "1"}, {warm.WARM_SECONDS_ENV: "0"})):
        done = subprocess.run(
            convert(warm_runner.data, tmp_path / f"work{index}", tmp_path / f"out{index}"),
            env={**warm_runner.env, **extra}, cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert COLD_LINE in done.stderr and WARM_LINE not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_command_stops_its_run(warm_runner, tmp_path, sig):
    work, out = tmp_path / "work", tmp_path / "out"
    cmd = convert(warm_runner.data, work, out)
    run = Command(cmd, warm_runner.env)
    run.wait_for(" slices on ")
    os.killpg(run.proc.pid, sig)  # as a terminal's Ctrl-C, or a kill of the job
    assert run.ended() == 128 + sig, run.text()[-3000:]
    assert f"error: stopped by {signal.Signals(sig).name}" in run.text()
    _wait(lambda: not _runs_of(warm_runner.state()), 5, "the run's end")
    assert_rerun_resumes([str(c) for c in cmd], work, out, warm_runner.expected)


@pytest.mark.slow
def test_a_killed_command_stops_its_run_and_the_runner_stays(warm_runner, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    cmd = convert(warm_runner.data, work, out)
    run = Command(cmd, warm_runner.env)
    run.wait_for(" slices on ")
    state = warm_runner.state()
    (forked,) = _runs_of(state)
    os.kill(run.proc.pid, signal.SIGKILL)
    _wait(lambda: f"run {forked} ended: " in warm_runner.log(), STOP_WITHIN, "the orphaned run's stop")
    assert f"run {forked} ended: {{'exit': 7}}" in warm_runner.log()
    assert "error: stopped: the tokenize-mixer command that asked for this run is gone" in run.text()
    assert alive(state["pid"]) and alive(state["api_pid"])
    assert not out.exists()  # nothing published
    assert_rerun_resumes([str(c) for c in cmd], work, out, warm_runner.expected)


@pytest.mark.slow
def test_a_closed_pipe_ends_the_command_as_a_cold_one(warm_runner, tmp_path):
    tool, *args = convert(warm_runner.data, tmp_path / "work", tmp_path / "out")
    cmd = [tool, "-v", *args]  # a line per slice: the pipe closes while the run writes
    shell = f"{' '.join(cmd)} 2>&1 | head -3 >/dev/null; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(
        ["bash", "-c", shell], env=warm_runner.env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == str(128 + signal.SIGPIPE), done.stderr[-3000:]
    _wait(lambda: not _runs_of(warm_runner.state()), 5, "the run's end")


@pytest.fixture
def short_dir():
    """A directory whose runner's socket path fits a Unix socket address (pytest's are too long)."""
    path = Path(tempfile.mkdtemp(prefix="tm-warm-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _direct_runner(env: dict[str, str], seconds: float) -> dict:
    """A runner started without a cold run (``launch_warm_runner``), once ready: its state."""
    _, directory, key = launch_warm_runner(env, seconds)
    state = directory / f"{key}.json"
    _wait(lambda: (directory / f"{key}.sock").exists(), 180, "a ready runner")
    return {**json.loads(state.read_text()), "socket": directory / f"{key}.sock", "state": state}


@pytest.mark.slow
def test_a_dead_api_stops_the_run_and_its_runner(warm_runner, tmp_path, short_dir):
    env = {**warm_runner.env, "XDG_RUNTIME_DIR": str(short_dir)}
    state = _direct_runner(env, 300)
    work, out = tmp_path / "work", tmp_path / "out"
    run = Command(convert(warm_runner.data, work, out), env)
    run.wait_for(" slices on ")
    os.kill(state["api_pid"], signal.SIGKILL)
    assert run.ended() == 5, run.text()[-3000:]
    assert "error: stopped: the warm runner's Prefect API server died" in run.text()
    _wait(lambda: not alive(state["pid"]), 5, "the runner's end")
    assert not state["socket"].exists() and not state["state"].exists()


@pytest.mark.slow
def test_a_runner_leaves_after_its_idle_time(warm_runner, short_dir):
    env = {**warm_runner.env, "XDG_RUNTIME_DIR": str(short_dir)}
    state = _direct_runner(env, 2)
    _wait(lambda: not alive(state["pid"]) and not alive(state["api_pid"]), 15, "the idle runner's end")
    assert not state["socket"].exists() and not state["state"].exists()
    assert list(state["socket"].parent.glob(".*")) == []  # no staged socket or state left


def test_the_key_follows_the_environment_the_directory_and_the_code(monkeypatch, tmp_path):
    base = warm.runner_key()
    assert warm.runner_key() == base
    monkeypatch.setenv("PWD", "/elsewhere")  # a shell's bookkeeping: the same runner
    monkeypatch.setenv(warm.WARM_SECONDS_ENV, "5")
    assert warm.runner_key() == base
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time by the runner's modules
    assert warm.runner_key() != base
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.chdir(tmp_path)  # Prefect reads settings files in the working directory
    assert warm.runner_key() != base
    monkeypatch.chdir(ROOT)
    source = ROOT / "sftmix" / "warm.py"
    before = os.stat(source)
    try:  # an edited file of ours: the runner's modules are out of date
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
        assert warm.runner_key() != base
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert warm.runner_key() == base


def test_no_runner_in_a_directory_others_can_enter(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory = tmp_path / f"tokenize-mixer-{os.getuid()}"
    assert warm.runner_dir() == directory and directory.stat().st_mode & 0o777 == 0o700
    os.chmod(directory, 0o755)
    assert warm.runner_dir() is None
    os.chmod(directory, 0o700)
    directory.rmdir()
    directory.symlink_to(tmp_path)
    assert warm.runner_dir() is None


def test_only_run_and_convert_without_a_configured_api_go_to_a_runner(monkeypatch):
    monkeypatch.setenv(warm.WARM_SECONDS_ENV, "60")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert warm.wants_warm(["tokenize-mixer", "run", "x.yaml"])
    assert warm.wants_warm(["tokenize-mixer", "convert", "--output_dir", "o"])
    assert warm.wants_warm(["tokenize-mixer", "-v", "run", "x.yaml"])
    assert not warm.wants_warm(["tokenize-mixer", "check", "out"])
    assert not warm.wants_warm(["tokenize-mixer", "run", "--help"])
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert not warm.wants_warm(["tokenize-mixer", "run", "x.yaml"])
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv(warm.WARM_SECONDS_ENV, "0")
    assert not warm.wants_warm(["tokenize-mixer", "run", "x.yaml"])
