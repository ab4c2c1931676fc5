"""Where the flow's Prefect API lives when the user has no server.

With no ``PREFECT_API_URL``, Prefect would start a temporary API server in this process *and in every
spawned worker*. We start one temporary server up front and point this process and the workers at it
(workers inherit the environment), so a run pays the start-up once.

The server is Prefect's own ephemeral one, launched with the command Prefect's
``SubprocessASGIServer`` runs, but without importing ``prefect.server`` here first: that import takes
seconds, and the server process needs seconds more to import the same modules, so launching it right
away lets its start-up overlap everything this process does before the flow starts.

Each temporary server has a database of its own, in a private directory on the local temp file system
(leased, removed when the server stops; one left by a killed command is removed by the next): commands
run at the same time never share the SQLite file under ``PREFECT_HOME`` (two at once there can answer
``503 database is locked``, and SQLite's locks are not to be trusted on a network file system). A new
database needs Prefect's migrations (about 4 s on 2 cores); the first server of a Prefect version
saves its migrated, still empty database as a template under ``PREFECT_HOME``, and later ones start
from a copy of it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from sftmix.runtime.ownership import leased, remove_abandoned
from sftmix.runtime.processes import die_with_parent_preexec
from sftmix.runtime.redaction import add_secret
from sftmix.runtime.stopping import (
    EXIT_API_LOST,
    RunStopped,
    exit_now,
    first_stop,
    record_stop,
    stops_held,
)
from sftmix.runtime.storage import temp_name

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer

logger = logging.getLogger(__name__)

#: uvicorn's exit status when it cannot start serving (e.g. the port was taken meanwhile).
_UVICORN_STARTUP_FAILURE = 3


def _prefect_app_dir() -> str:
    """Where the ``prefect`` package lives (uvicorn's ``--app-dir``), found without importing it."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("Prefect is not installed")
    return str(Path(spec.origin).parent.parent)


#: The private directories of temporary servers, in the temp directory (``TMPDIR``); recognised as ours by
#: their lease, never by this prefix alone.
PRIVATE_DIR_PREFIX = "tokenize-mixer-api-"
#: Names the database of a temporary server (a user's explicit one is left as it is).
DATABASE_URL_ENV = "PREFECT_SERVER_DATABASE_CONNECTION_URL"


def remove_abandoned_private_dirs() -> None:
    """The private directories of temporary servers whose command was killed outright (their lease says
    so: the process is gone, or its heartbeat is old); every ``run`` and ``convert`` does this first, an
    up-to-date one (which starts no server) included."""
    remove_abandoned(Path(tempfile.gettempdir()), PRIVATE_DIR_PREFIX)


def _database_template() -> Path:
    """Where a migrated, empty database of this Prefect version is kept, found without importing it."""
    from importlib.metadata import version

    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    return home / "tokenize-mixer" / f"api-database-{version('prefect')}.db"


def _save_template(database: Path, template: Path) -> None:
    """Copy a just-migrated database (the server holds it open: SQLite's online backup gives a consistent
    copy) to ``template``, atomically; a failure only costs the next command the migrations."""
    staging = temp_name(template)  # (ours by its writer tag: removable once its writer is gone)
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        source = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
        try:
            target = sqlite3.connect(staging)
            try:
                source.backup(target)
            finally:
                target.close()
        finally:
            source.close()
        os.replace(staging, template)
        logger.debug("saved the migrated Prefect database as %s", template)
    except (OSError, sqlite3.Error) as exc:
        logger.debug("could not save the Prefect database template %s: %s", template, exc)
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporaryServer:
    """Prefect's ephemeral API server in a subprocess (what ``SubprocessASGIServer`` starts).

    ``pass_settings``: hand it this process's Prefect settings, as Prefect does, for settings made in
    this process (a test's temporary settings); without, the server reads the same profile, files and
    environment as this process, and this process need not import Prefect before launching it."""

    def __init__(self, pass_settings: bool = True) -> None:
        self.pass_settings = pass_settings
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.auth_string = secrets.token_urlsafe(24)
        add_secret(self.auth_string)
        self.log: IO[bytes] | None = None
        self.ready = False  # it answered its health check
        self._watched = False
        self._private = contextlib.ExitStack()
        self.database: Path | None = None  # its own, unless the environment names one
        self._template: Path | None = None  # to save once migrated (there was none)

    def log_tail(self, nbytes: int = 2000) -> str:
        if self.log is None:
            return ""
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - nbytes))
        return self.log.read().decode("utf-8", "replace").strip()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _settings(self) -> dict[str, str]:
        if not self.pass_settings:
            return {}
        from prefect.settings import get_current_settings

        return get_current_settings().to_environment_variables(exclude_unset=True)

    def _private_database(self) -> dict[str, str]:
        """A database of this server's own (see the module's docstring), as its environment setting."""
        if os.environ.get(DATABASE_URL_ENV):
            return {}
        if self.database is None:
            directory = (
                Path(tempfile.gettempdir()) / f"{PRIVATE_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            )
            self._private.enter_context(leased(directory, mode=0o700))
            self.database = directory / "prefect.db"
            template = _database_template()
            try:
                shutil.copyfile(template, self.database)
            except OSError:
                self._template = template  # migrated from scratch by the server, then saved
        return {DATABASE_URL_ENV: f"sqlite+aiosqlite:///{self.database}"}

    def launch(self) -> None:
        self.port = _free_port()
        logger.info("starting a temporary Prefect API server on http://127.0.0.1:%d", self.port)
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **self._private_database(),
            **self._settings(),
            # Only this command and its workers (which inherit PREFECT_API_AUTH_STRING) may use it: a
            # web page the user visits cannot call a loopback API it does not know the secret of.
            "PREFECT_SERVER_API_AUTH_STRING": self.auth_string,
        }
        if self.log is None:
            self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        # Its own session: a terminal's Ctrl-C or a closed pipe is for this command to handle, and
        # the server must keep answering while the run stops; it dies with this process however
        # that dies (PDEATHSIG), and writes to a file, not to a pipe someone may close.
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--app-dir",
                _prefect_app_dir(),
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec,
        )

    def wait_ready(self, timeout: float) -> None:
        """Return once the API answers its health check; relaunch on another port if this one was
        taken meanwhile. A server killed before it answered stops the run (:meth:`died`)."""
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                assert self.process is not None
                code = self.process.poll()
                if code == _UVICORN_STARTUP_FAILURE:
                    self.launch()
                    if self._watched:
                        self.watch()
                    continue
                if code is not None and code < 0:
                    raise record_stop(self.died(code))
                if code is not None:
                    raise RuntimeError(
                        f"the temporary Prefect API server exited with status {code}: {self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        self.ready = True
                        if self._template is not None and self.database is not None:
                            _save_template(self.database, self._template)
                            self._template = None
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"the temporary Prefect API server did not answer within {timeout:.0f} s")

    def died(self, code: int) -> RunStopped:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        when = "" if self.ready else " before it answered"
        return RunStopped(f"stopped: the temporary Prefect API server died{when} ({how})", EXIT_API_LOST)

    def watch(self) -> None:
        """Stop the run at once if this server dies under it, from the moment it is launched: it does
        not come back, and the run cannot report, so waiting on Prefect's retries would only delay the
        same end. Before it answers, only a kill counts (a server that could not start is
        :meth:`wait_ready`'s to relaunch, or to replace with one started Prefect's way)."""
        process = self.process
        self._watched = True

        def wait_for_exit() -> None:
            assert process is not None
            code = process.wait()
            if self.process is not process:  # stopped by us, or relaunched
                return
            if not self.ready and code >= 0:
                return
            # At once, from here: the main thread would first report the crash to the API that is
            # gone (seconds of retries). What the unwinding would clean up is cleaned up here.
            exit_now(record_stop(self.died(code)), forced=True)

        threading.Thread(target=wait_for_exit, name="temporary-api-watch", daemon=True).start()

    def stop(self) -> None:
        process, self.process = self.process, None  # first: the watch must not take this for a death
        try:
            if process is not None:
                logger.info("stopping the temporary Prefect API server")
                if first_stop() is not None:  # the run was stopped: nothing of the server is kept, and
                    process.kill()  # one still starting answers a SIGTERM only after seconds (1.7-2.1 s)
                else:
                    process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:  # a stop that comes while the server is waited for, or during this, still removes it all
            with stops_held():
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
                if self.log is not None:
                    self.log.close()
                    self.log = None
                self._private.close()  # its database, once nothing holds it open
                self.database = None


def _set_api_url(url: str | None, auth_string: str | None = None) -> None:
    """Point this process (every thread, not only the current context) and future workers at ``url``."""
    import prefect.context

    for name, value in (("PREFECT_API_URL", url), ("PREFECT_API_AUTH_STRING", auth_string)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # Threads Prefect starts later (event and log workers) read the process-global settings; without
    # this they would find no API URL and start an ephemeral server of their own.
    refresh = getattr(prefect.context, "refresh_global_settings_context", None)
    if refresh is not None:
        refresh()
    else:  # older Prefect (the function came with PrefectHQ/prefect#20393): what it does
        prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.root_settings_context()


@contextlib.contextmanager
def prefect_api(
    prepare: Callable[[], None] | None = None,
    launch_first: bool = False,
    before_launch: Callable[[], None] | None = None,
) -> Iterator[str]:
    """Yield the API URL in use: the configured server, or a temporary one for this command.

    ``prepare`` runs before the flow: while the temporary server starts, or at once with a configured
    one (the plan, the head start: work the run uses next).
    ``launch_first`` (the command, one run per process): the temporary server is launched before this
    process imports Prefect (about 1 s), unless the environment names an API; should a Prefect profile
    name one, it is stopped again. ``before_launch`` runs before any server is launched (the plan of a
    rerun that may find its output up to date, and then starts no API); the threads it starts have ended
    when it returns, so the server is still launched from a single thread (``preexec_fn``)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    servers = _Servers(TemporaryServer(pass_settings=not launch_first))
    server = servers.ours
    try:  # from before the launch: a stop that comes during it still removes the private directory
        if before_launch is not None:
            before_launch()
        if launch_first and not os.environ.get("PREFECT_API_URL"):
            server.launch()
            server.watch()
        configured = _configured_api()
        if configured:
            if server.process is not None:
                logger.info("the Prefect profile names an API, %s: the run uses it", configured)
                server.stop()
            if prepare is not None:  # the plan and the head start run ahead of the flow here too
                prepare()
            yield configured
            return
        # Prefect's default 20 s is too short on a busy machine; a slow start is not a reason to fail.
        timeout = int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
        _launch_then_prepare(server, prepare)
        api_url, auth_string = servers.answering(timeout)
        _set_api_url(api_url, auth_string)
        try:
            from prefect.settings import temporary_settings

            with temporary_settings(_temporary_server_settings(api_url, auth_string)):
                yield api_url
        finally:
            from prefect.logging.handlers import APILogWorker

            # send the last log lines while the server still listens (not for long when the run was
            # stopped: the stop may be that the API is gone)
            APILogWorker.drain_all(timeout=1 if first_stop() is not None else 10)
            _set_api_url(None)
    finally:
        servers.stop()


def _configured_api() -> str | None:
    """The API the environment or a Prefect profile names, if any; Prefect's settings are imported here,
    after an early launch. The secrets a profile may set are masked in the logs from now on."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    configured = PREFECT_API_URL.value()
    add_secret(PREFECT_API_AUTH_STRING.value())  # (a profile may set them)
    add_secret(PREFECT_API_KEY.value())
    return configured


def _launch_then_prepare(server: TemporaryServer, prepare: Callable[[], None] | None) -> None:
    """Launch the temporary server (unless launched first), and ``prepare`` while it starts."""
    if server.process is None:
        server.launch()
        server.watch()
    if prepare is not None:
        prepare()
    # after prepare, which does not need it: the head start's tokenizing begins sooner
    import tokenize_mixer.flows.tokenize_mixer  # noqa: F401


class _Servers:
    """The command's temporary API server, and Prefect's own started in its place should ours not
    answer; both are stopped at the end, ours first."""

    def __init__(self, ours: TemporaryServer) -> None:
        self.ours = ours
        self.fallback: SubprocessASGIServer | None = None

    def answering(self, timeout: int) -> tuple[str, str | None]:
        """The URL and the secret of a server that answers: ours, or else one started Prefect's way."""
        try:
            self.ours.wait_ready(timeout)
            return self.ours.api_url, self.ours.auth_string
        except RuntimeError as exc:  # e.g. a Prefect whose server is launched differently: its own way
            logger.warning("%s; starting it the way Prefect does", exc)
            self.ours.stop()
            from prefect.server.api.server import SubprocessASGIServer

            # (kept before it starts: one that fails to start is still stopped)
            self.fallback = SubprocessASGIServer()
            self.fallback.start(timeout=timeout)
            return self.fallback.api_url, None

    def stop(self) -> None:
        self.ours.stop()
        if self.fallback is not None:
            self.fallback.stop()


def _temporary_server_settings(api_url: str, auth_string: str | None) -> dict:
    """The Prefect settings of a run on a temporary server."""
    import prefect.settings
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        PREFECT_UI_URL,
    )

    # Our own server does not come back once it is gone: one quick retry (not five with
    # backoff, minutes per request) before a run that lost it stops.
    # No "View at http://127.0.0.1:PORT/..." line: this server stops with the command.
    # No flow run heartbeats: they let a server find runs that died, and this server dies with
    # the run; Prefect's heartbeat thread sleeps in whole seconds and the flow's end waits for
    # it to wake (measured: up to 1.0 s added to every command, 0.5 s on average).
    updates: dict = {PREFECT_API_URL: api_url, PREFECT_CLIENT_MAX_RETRIES: 1, PREFECT_UI_URL: ""}
    heartbeat = getattr(prefect.settings, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)  # Prefect 3.5+
    if heartbeat is not None:
        updates[heartbeat] = None
    if auth_string is not None:
        updates[PREFECT_API_AUTH_STRING] = auth_string
    return updates
