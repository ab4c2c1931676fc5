"""Every way a run can stop ends it within seconds, with an exit code of its own and one line: real
signals to real process groups, a real closed pipe, a killed worker, a killed API server, a cancel
through the Prefect API. Finished slices stay checkpointed and a rerun gives the same bytes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sftmix.output.digest import compare
from tests.cli_runs import assert_rerun_resumes, cli_env, convert_command, left_in_shm, semaphores
from tokenize_mixer.flows.workers.worker_start import START_METHOD_ENV

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402

pytestmark = pytest.mark.slow

#: Seconds a stop may take, from the signal to the exit of the command.
STOP_WITHIN = 10.0

#: The environment that makes the command spawn its workers as Prefect does.
SPAWNED = {START_METHOD_ENV: "spawn"}


def command(data: Path, work: Path, out: Path, workers: int = 2) -> list[str]:
    """The workers are forked from the command's fork server (flows.workers.worker_start); run with ``SPAWNED``
    in the environment, they are spawned."""
    return convert_command(data, work, out, 500, "--runner", "process", "--workers", str(workers))


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> tuple[Path, Path]:
    """60,000 short chats (120 slices: long enough to stop mid-run) and their uninterrupted output."""
    root = tmp_path_factory.mktemp("stop")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(11), 60_000)))
    expected = root / "expected"
    subprocess.run(command(data, root / "work-ref", expected), env=cli_env(), check=True, capture_output=True)
    return data, expected


class Run:
    """The CLI in a process group of its own (as a shell starts a job), its stderr read as it comes."""

    def __init__(self, cmd: list[str], api_url: str | None = None, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            cmd,
            env={**cli_env(api_url), **(env or {})},
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.cmd = cmd
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for_slices(self, n: int = 3) -> None:
        """Until the flow's fan-out runs (its "N slices on W worker(s)" line) and ``n`` slices are
        checkpointed in the run's work directory (a line per slice is a debug line)."""
        work = Path(self.cmd[self.cmd.index("--work_dir") + 1])
        deadline = time.monotonic() + 240
        while not any(" slices on " in line for line in self.lines) or (
            len(list(work.glob("slices/*/*/manifest.json"))) < n
        ):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)[-3000:]
            time.sleep(0.05)

    def children(self, running: str = "", descendants: bool = True) -> list[int]:
        """Its child processes and theirs (those whose command line contains ``running``)."""
        found, parents = [], [self.proc.pid]
        while parents:
            out = subprocess.run(["pgrep", "-P", str(parents.pop())], capture_output=True, text=True).stdout
            found += [int(p) for p in out.split()]
            if descendants:
                parents += [int(p) for p in out.split()]
        return [p for p in found if not running or running in _cmdline(p)]

    def workers(self, forked: bool) -> list[int]:
        """The pool's worker processes: spawned by the command, or forked by its fork server (the one
        child of the command that runs multiprocessing's fork server, flows.workers.worker_start)."""
        if not forked:
            return self.children("spawn_main", descendants=False)
        (server,) = self.children("multiprocessing.forkserver", descendants=False)
        out = subprocess.run(["pgrep", "-P", str(server)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stopped(self, since: float) -> int:
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("the run did not stop: " + "".join(self.lines)[-3000:]) from None
        elapsed = time.monotonic() - since
        assert elapsed < STOP_WITHIN, f"took {elapsed:.1f} s to stop"
        self.reader.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def _gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in _status(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # ended meanwhile
        return ""


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return ""


def _rerun_matches(data: Path, work: Path, out: Path, expected: Path) -> None:
    assert not out.exists(), "a stopped run published"
    assert_rerun_resumes(command(data, work, out), work, out, expected)


def _one_line_reason(stderr: str, reason: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and reason in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.parametrize(
    ("how", "code", "reason"),
    [
        ("SIGINT to the process group (Ctrl-C)", 130, "stopped by SIGINT"),
        ("SIGTERM to the process only (a pod eviction)", 143, "stopped by SIGTERM"),
        ("SIGHUP to the process group (terminal closed)", 129, "stopped by SIGHUP"),
    ],
)
def test_a_signal_stops_the_run_cleanly_and_a_rerun_resumes(chats, tmp_path, how, code, reason):
    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    run = Run(command(data, work, out))
    run.wait_for_slices()
    children = run.children()
    assert len(children) >= 2  # the temporary API server and the pool's workers
    held = semaphores(run.proc.pid)
    assert held  # the pool's queues
    sig = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}[how.split()[0]]
    since = time.monotonic()
    if "process only" in how:
        os.kill(run.proc.pid, sig)
    else:
        os.killpg(run.proc.pid, sig)
    assert run.stopped(since) == code
    _one_line_reason(run.stderr, reason)
    assert _gone(children), "a worker or the API server outlived the run"
    assert not left_in_shm(held), "the pool's semaphores outlived the run"
    _rerun_matches(data, work, out, expected)


def test_a_signal_while_the_api_starts_stops_the_head_start(chats, tmp_path):
    """Slices are tokenized while the temporary API starts (flows.workers.head_start). A fresh Prefect home makes
    that start long (the server creates its database first), as on a user's first run."""
    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    run = Run(command(data, work, out, workers=4), env={"PREFECT_HOME": str(tmp_path / "prefect-home")})
    deadline = time.monotonic() + 120
    while not list(work.glob("slices/*/*/manifest.json")):  # a head-start slice finished
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr[-3000:]
        time.sleep(0.05)
    assert "Beginning flow run" not in run.stderr  # the API is not answering yet
    children = run.children()
    assert len(run.workers(forked=True)) >= 2  # the head start's workers
    held = semaphores(run.proc.pid)
    since = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.stopped(since) == 130
    _one_line_reason(run.stderr, "stopped by SIGINT")
    assert _gone(children), "a head-start worker or the API server outlived the run"
    assert held and not left_in_shm(held), "the head start's semaphores outlived the run"
    finished = len(list(work.glob("slices/*/*/manifest.json")))
    _rerun_matches(data, work, out, expected)  # the head start's slices are reused
    assert json.loads((out / "run_report.json").read_text())["slices_reused"] >= finished


def test_a_closed_output_pipe_stops_the_run(chats, tmp_path):
    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    code_file = tmp_path / "code"
    script = f'"$@" 2>&1 | grep -m1 "progress [1-9]"; echo "${{PIPESTATUS[0]}}" > {code_file}'
    shell = subprocess.Popen(
        ["bash", "-c", script, "_", *command(data, work, out)],
        env={**cli_env(), "TOKENIZE_MIXER_PROGRESS_SECONDS": "1"},  # a summary line a second
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert shell.stdout is not None
    assert "slices" in shell.stdout.readline()  # grep matched and exits: the run's pipe is closed
    since = time.monotonic()
    assert shell.wait(timeout=60) == 0
    assert time.monotonic() - since < STOP_WITHIN
    assert code_file.read_text().strip() == str(128 + signal.SIGPIPE)
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout
    assert _gone([int(p) for p in left.split()]), left
    _rerun_matches(data, work, out, expected)


@pytest.mark.parametrize("forked", [False, True], ids=["spawned", "forked"])
def test_a_killed_worker_is_replaced_and_the_bytes_are_the_same(chats, tmp_path, forked):
    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    run = Run(command(data, work, out), env=None if forked else SPAWNED)
    run.wait_for_slices()
    workers = run.workers(forked)
    os.kill(workers[0], signal.SIGKILL)  # what the OOM killer does
    try:
        code = run.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:  # (seen once, in CI: what was each process waiting for?)
        pids = ",".join(str(p) for p in [run.proc.pid, *run.children()])
        tree = subprocess.run(
            ["ps", "-o", "pid,ppid,stat,wchan:24,args", "-p", pids], capture_output=True, text=True
        ).stdout
        os.killpg(run.proc.pid, signal.SIGKILL)
        pytest.fail(f"the run did not end after its worker was killed:\n{tree}\n{run.stderr[-3000:]}")
    assert code == 0, run.stderr[-3000:]
    run.reader.join(10)
    assert "rebuilding the pool" in run.stderr
    result = compare(out, expected)
    assert result.matches, result.render()
    assert not [p for p in work.glob("slices/*/*/*") if ".tmp-" in p.name]


@pytest.mark.parametrize("forked", [False, True], ids=["spawned", "forked"])
def test_a_command_killed_outright_leaves_no_process_behind(chats, tmp_path, forked):
    """kill -9 of the command alone, not its group: its API server, its workers and the workers' fork
    server end by themselves (a rerun resumes: test_kill). multiprocessing's resource tracker, the last,
    unlinks the semaphores the command held, and says nothing of them."""
    data, _ = chats
    run = Run(command(data, tmp_path / "work", tmp_path / "out"), env=None if forked else SPAWNED)
    run.wait_for_slices()
    left = run.children()
    assert run.workers(forked)
    held = semaphores(run.proc.pid)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=30)
    assert _gone(left, within=10), [(p, _cmdline(p)[:90]) for p in left if Path(f"/proc/{p}").exists()]
    run.reader.join(10)
    assert held and not left_in_shm(held), "the pool's semaphores outlived the command"
    assert "leaked semaphore" not in run.stderr, run.stderr[-3000:]


def test_a_dead_api_server_stops_the_run(chats, tmp_path):
    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    run = Run(command(data, work, out))
    run.wait_for_slices()
    server = run.children("uvicorn")
    assert len(server) == 1
    left = run.children()
    since = time.monotonic()
    os.kill(server[0], signal.SIGKILL)
    assert run.stopped(since) == 5
    _one_line_reason(run.stderr, "the temporary Prefect API server died")
    assert _gone(left), "a worker outlived the run"
    _rerun_matches(data, work, out, expected)


def test_a_cancel_through_the_api_stops_the_run_without_publishing(chats, tmp_path, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    run = Run(command(data, work, out), api_url=prefect_api)
    run.wait_for_slices()
    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
    with get_client(sync_client=True) as client:
        flow_run = next(r for r in client.read_flow_runs(flow_run_filter=running) if r.flow_id)
    subprocess.run(
        [sys.executable, "-m", "prefect", "flow-run", "cancel", str(flow_run.id)],
        env=cli_env(prefect_api),
        check=True,
        capture_output=True,
    )
    assert run.stopped(time.monotonic()) == 4
    _one_line_reason(run.stderr, "cancelled through the Prefect API")
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).state.is_cancelled()
    _rerun_matches(data, work, out, expected)


def test_a_lost_prefect_server_stops_the_run(chats, tmp_path):
    """Server mode: the run was given a server (PREFECT_API_URL), which dies mid-run."""
    from tokenize_mixer.flows.api.runtime import TemporaryServer

    data, expected = chats
    work, out = tmp_path / "work", tmp_path / "out"
    server = TemporaryServer()
    server.launch()
    try:
        server.wait_ready(120)
        os.environ["PREFECT_API_AUTH_STRING"] = server.auth_string
        try:
            run = Run(command(data, work, out), api_url=server.api_url)
        finally:
            os.environ.pop("PREFECT_API_AUTH_STRING")
        run.wait_for_slices()
        since = time.monotonic()
        assert server.process is not None
        server.process.kill()
        assert run.stopped(since) == 5
    finally:
        server.stop()
    _one_line_reason(run.stderr, "the Prefect API stopped answering")
    _rerun_matches(data, work, out, expected)


SUPERVISED = """
import sys, time
from sftmix.runtime.stopping import follow_supervisor
def report(stop):
    open(sys.argv[1], "w").write(stop.reason)
follow_supervisor("the test's supervisor", before_exit=report, grace_seconds=1.0)
print("ready", flush=True)
time.sleep(60)  # busy in a long step: no check ever raises the recorded stop
"""


def _orphaned(script: str, *args: Path) -> int:
    """Run ``script`` under a supervisor (bash) until it prints "ready", then SIGKILL the supervisor
    (the reader of the script's output pipe goes with it); the script's pid."""
    supervisor = subprocess.Popen(
        ["bash", "-c", f'{sys.executable} -c "$0" "$@" & echo $!; wait', script, *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(supervisor.stdout.readline())
    assert supervisor.stdout.readline() == "ready\n"
    supervisor.kill()
    supervisor.stdout.close()
    supervisor.wait()
    return child


def test_a_process_whose_supervisor_dies_reports_it_and_ends(tmp_path):
    """A flow-run process whose worker is killed outright: the stop is reported (the flow run marked
    Crashed, here a file) and the process ends with its own exit code even when its main thread is
    busy; its output pipe is not what ends it."""
    note = tmp_path / "reason.txt"
    child = _orphaned(SUPERVISED, note)
    assert _gone([child], within=STOP_WITHIN)
    assert "the test's supervisor" in note.read_text() and "is gone" in note.read_text()


PUBLISHES_WHEN_ORPHANED = """
import os, signal, sys, time
from pathlib import Path
from sftmix.output.publish import publish_local
from sftmix.runtime.stopping import RunStopped, follow_supervisor
follow_supervisor("the test's supervisor", poll_seconds=600, grace_seconds=600)
signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the kernel's notice lost: only a look finds the stop
staging, out, result = map(Path, sys.argv[1:4])
staging.mkdir()
(staging / "token_ids_part_0.npy").write_bytes(b"tokens")
parent = os.getppid()
print("ready", flush=True)
while os.getppid() == parent:  # the watcher's next round is minutes away
    time.sleep(0.01)
try:
    publish_local(staging, out, overwrite=False)
    result.write_text("published")
except RunStopped as stop:
    result.write_text("refused: " + stop.reason)
"""


def test_a_process_whose_supervisor_just_died_does_not_publish(tmp_path):
    """The moment between a supervisor's death and the watcher's next look: a publish that starts
    then is refused (a flow run once published its output though its worker had been killed)."""
    out, result = tmp_path / "out", tmp_path / "result.txt"
    child = _orphaned(PUBLISHES_WHEN_ORPHANED, tmp_path / "staging", out, result)
    assert _gone([child], within=STOP_WITHIN)
    assert result.read_text().startswith("refused: stopped: the test's supervisor"), result.read_text()
    assert not out.exists()


FINISHING = """
import io, sys
from sftmix.runtime.stopping import finish, install_signal_handlers
install_signal_handlers()
sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False), buffer_size=4 << 20))
sys.stdout.write("x" * (1 << 20))  # held in the buffer: finish's flush blocks on the full pipe
sys.stderr.write("ready\\n")
sys.stderr.flush()
finish(0)
"""


def test_a_stop_while_the_command_finishes_does_not_change_its_exit_code(tmp_path):
    """Once the command's work is done and its code decided, a stop that comes while it flushes and
    runs its at-exit work (a reader that went away after the last line) is not raised into that work:
    it once ended a published run with exit 1 and a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FINISHING], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stderr.readline() == b"ready\n"
    time.sleep(0.5)  # blocked in finish's flush
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert len(out) == 1 << 20


WEDGED = """
import os, subprocess, sys, time
from pathlib import Path
from sftmix.runtime.pipes import guard_std_streams
from sftmix.runtime.stopping import RUN_STOP_NOTE, install_signal_handlers, mark_published, on_forced_exit, set_stop_note
from sftmix.runtime.watchdog import arm_watchdog
guard_std_streams()
install_signal_handlers()
arm_watchdog()
set_stop_note(RUN_STOP_NOTE)
staging = Path(sys.argv[1])
staging.mkdir()
on_forced_exit(1, staging.rmdir)
if sys.argv[2] == "published":
    mark_published("out/x")
sys.stderr.write(sys.argv[3])
child = None
while True:  # a collector wedged for good: it swallows every stop raised into it
    try:
        if child is None:
            child = subprocess.Popen(["sleep", "600"])
            print(child.pid, flush=True)
        time.sleep(1000)
    except BaseException:
        pass
"""


@pytest.mark.parametrize("published", [False, True], ids=["before-publishing", "after-publishing"])
def test_a_stop_ends_the_process_within_seconds_even_when_the_run_is_wedged(tmp_path, published):
    """The last resort: whatever thread is stuck, once a stop is recorded the process ends with that
    stop's code (0 once the output is published), its children killed, its staging removed."""
    staging = tmp_path / "staging"
    proc = subprocess.Popen(
        [sys.executable, "-c", WEDGED, str(staging), "published" if published else "-", ""],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = int(proc.stdout.readline())
    since = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - since < STOP_WITHIN
    assert _gone([child]), "the stopped process left its child running"
    assert not staging.exists()
    if published:
        assert proc.returncode == 0
        assert err.strip() == "note: stopped by SIGTERM after the output was published: out/x is complete"
    else:
        assert proc.returncode == 143
        _one_line_reason(err, "stopped by SIGTERM; nothing was published")


def test_the_stop_line_starts_a_line_of_its_own_after_a_partial_one(tmp_path):
    """Prefect reports a log upload that failed (the API server just died) as text with no newline at
    the end; the stop's line that follows is still a line of its own (it was once glued to it)."""
    partial = "--- Error logging to API ---\nServer disconnected without sending a response."
    proc = subprocess.Popen(
        [sys.executable, "-c", WEDGED, str(tmp_path / "staging"), "-", partial],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and _gone([child])
    assert err.startswith(partial + "\n"), err
    _one_line_reason(err, "stopped by SIGTERM; nothing was published")


def test_a_ctrl_c_at_any_moment_of_the_start_prints_one_line(tmp_path):
    """From the command's first line on (tokenize_mixer.command), before its heavy imports: no traceback. The
    interpreter's own start (about 50 ms) comes before any of our code and is left out."""
    tool = Path(sys.executable).parent / "tokenize-mixer"
    for delay in (0.08, 0.12, 0.2, 0.3, 0.5, 0.8):
        proc = subprocess.Popen(
            [str(tool), "convert", "--dataset_mixer_list", str(tmp_path / "x.jsonl"), "1.0",
             "--output_dir", str(tmp_path / "out"), "--tokenizer_name_or_path", "examples/tokenizer"],
            cwd=ROOT, env=cli_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 2:  # it was quicker than the signal: refused the missing input
            continue
        assert proc.returncode == 130, (delay, err[-3000:])
        _one_line_reason(err, "stopped by SIGINT")


def test_a_stop_while_an_input_is_decompressed_leaves_no_temp_file(tmp_path):
    """A compressed input is decompressed to a copy by a thread that works beside the plan, which a stop
    does not unwind (the command ends at once): the copy's temp file must go with the command, not stay in
    the work directory (hundreds of GB at our users' sizes) until a rerun of that same version."""
    import gzip

    from sftmix.runtime.storage import TMP_MARK

    block = "".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(3), 20_000))
    data = tmp_path / "chats.jsonl.gz"
    with gzip.open(data, "wt", compresslevel=1, encoding="utf-8") as fh:
        for _ in range(60):  # ~250 MB to decompress: long enough to be stopped in the middle
            fh.write(block)
    work, out = tmp_path / "work", tmp_path / "out"
    copies = work / "datasets-cache" / "decompressed"

    def temps() -> list[Path]:
        return [p for p in copies.rglob("*") if TMP_MARK in p.name] if copies.exists() else []

    run = Run(command(data, work, out))
    deadline = time.monotonic() + 120
    while not temps() and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)  # (the command's signal handling is in place well before: its plan is running)
    assert temps(), f"the copy was not seen being written when stopped:\n{run.stderr[-3000:]}"
    since = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.stopped(since) == 130
    _one_line_reason(run.stderr, "stopped by SIGINT")
    assert temps() == []


_TRACKER = """
import os, signal, sys
from multiprocessing import resource_tracker
which = sys.argv[1]
if which == "slices":
    from tokenize_mixer.flows.workers.pool import process_pool
    pool = process_pool(1)
    pool.__enter__()
else:
    from sftmix.output.part_writing import worker_processes
    pools = worker_processes(1)
    pools.__enter__()
pid = resource_tracker._resource_tracker._pid
with open(f"/proc/{pid}/status") as fh:
    blocked = int(next(line for line in fh if line.startswith("SigBlk:")).split()[1], 16)
print(bool(blocked & (1 << (signal.SIGHUP - 1))), flush=True)
os._exit(0)
"""


# A stop's exit, with a pool's thread letting a semaphore go right after the command's descendants
# (the resource tracker among them) are killed: the moment a CI run's SIGINT in the head start met.
_LET_GO_AFTER_THE_KILL = """
import gc, multiprocessing, time
from sftmix.runtime import stopping
from sftmix.runtime.processes import kill_descendants, start_resource_tracker
start_resource_tracker()
held = [multiprocessing.get_context("spawn").Lock()]  # a named semaphore, registered with the tracker
def killed_then_let_go(within=0.0):
    kill_descendants(within)
    time.sleep(0.2)  # (the pool's thread sees its workers gone once they are: the tracker is gone too)
    held.clear()
    gc.collect()  # its clean-up reports it gone: to a tracker started again, if any
    time.sleep(0.5)  # (such a tracker has printed by now)
stopping.kill_descendants = killed_then_let_go
stopping.exit_now(stopping.RunStopped("stopped by SIGINT", 130))
"""


def test_a_semaphore_let_go_as_the_stop_kills_the_tracker_prints_nothing():
    """The stop kills every process the command started, multiprocessing's resource tracker too; a
    semaphore let go of after that started a new tracker, which printed a ``KeyError`` traceback for
    each it never saw registered (CI: SIGINT while the API starts, two tracebacks after the one line)."""
    done = subprocess.run(
        [sys.executable, "-c", _LET_GO_AFTER_THE_KILL], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 130, done.stderr
    _one_line_reason(done.stderr, "stopped by SIGINT")
    assert "relaunching" not in done.stderr, done.stderr


# A forced stop (the API died under the run) while a process of the run still writes into its staging
# directory, as the tail's writer processes do.
_FORCED_WHILE_WRITING = """
import subprocess, sys, time
from pathlib import Path
from sftmix.runtime import stopping
from sftmix.runtime.ownership import leased
from sftmix.runtime.storage import TMP_MARK
writer = "import itertools, pathlib, sys\\nfor k in itertools.count(): (pathlib.Path(sys.argv[1]) / f'part-{k}').write_bytes(b'x')"
with leased(Path(sys.argv[1]) / f".out{TMP_MARK}test") as staging:
    subprocess.Popen([sys.executable, "-c", writer, str(staging)])
    while len(list(staging.iterdir())) < 200:
        time.sleep(0.01)
    stopping.exit_now(stopping.RunStopped("stopped: the API died (test)", 5), forced=True)
"""


def test_a_forced_stop_removes_the_staging_its_processes_were_writing_into(tmp_path):
    """A forced exit (the temporary API died, the watchdog) removes the run's staging directory, and the
    processes writing into it are killed first: removed while they still wrote, it was left behind (a CI
    soak, kill-api-late during the tail, the tail in processes)."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _FORCED_WHILE_WRITING, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == 5, done.stderr
        _one_line_reason(done.stderr, "stopped: the API died (test)")
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pool", ["slices", "tail"])
def test_the_resource_tracker_of_a_worker_pool_never_sees_sighup(pool):
    """multiprocessing's resource tracker ignores SIGINT and SIGTERM but not SIGHUP: a SIGHUP to the group
    killed it, the stopping run's next semaphore started a new one, and that one printed a KeyError
    traceback per semaphore into the run's stderr (a soak trial, seed 649961, a spawned pool). Started by
    either pool, it has SIGHUP blocked for life."""
    found = subprocess.run(
        [sys.executable, "-c", _TRACKER, pool], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert found.stdout.strip() == "True", found.stdout + found.stderr[-3000:]


# A stop's exit unlinks the semaphores of its own record; a process forked from one that holds them (it
# inherits the record, not the semaphores) unlinks none of them.
_FORKED_CHILD_UNLINKS_NOTHING = """
import multiprocessing, os
from sftmix.runtime.processes import start_resource_tracker, unlink_held_semaphores
start_resource_tracker()
held = multiprocessing.get_context("spawn").Lock()  # a named semaphore, on the record
name = held._semlock.name
child = os.fork()
if child == 0:
    unlink_held_semaphores()
    os._exit(0)
os.waitpid(child, 0)
print(os.path.exists("/dev/shm/sem." + name.lstrip("/")), flush=True)
unlink_held_semaphores()
print(os.path.exists("/dev/shm/sem." + name.lstrip("/")), flush=True)
"""


def test_a_stop_unlinks_only_the_semaphores_its_own_process_made():
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD_UNLINKS_NOTHING],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
