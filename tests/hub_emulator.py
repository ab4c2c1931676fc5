"""A Hugging Face hub for tests: one dataset repository served from a local directory over loopback,
speaking the part of the hub's HTTP API that ``huggingface_hub`` and ``datasets`` use to resolve a
dataset, list its files and download them (whole or by byte range). No network: the real clients,
pointed at it with ``HF_ENDPOINT``.

A test can hold a file's whole download (not its ranged reads) until it lets it go, or fail it, and read
which requests were made.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import threading
import time
import urllib.parse
from pathlib import Path

from tests.ports import free_port


def declared_card(*strings: str) -> str:
    """A dataset card that declares chat rows' features (string fields ``strings``, then ``messages``):
    the plan reads its files by batch, cast to them."""
    lines = ["---", "license: odc-by", "dataset_info:", "  features:"]
    for name in strings:
        lines += [f"  - name: {name}", "    dtype: string"]
    lines += ["  - name: messages", "    list:", "    - name: role", "      dtype: string"]
    lines += ["    - name: content", "      dtype: string", "---", "# chats, their features declared", ""]
    return "\n".join(lines)


#: A hub dataset's card that says nothing of its rows: the plan reads its files.
PLAIN_CARD = "---\nlicense: odc-by\n---\n"
#: The card of rows with an ``id`` and ``messages`` (the tests' and the soak's).
DECLARED_CARD = declared_card("id")
#: A card whose files ``datasets`` reads in an encoding of its own (UTF-8 after a BOM, where there is
#: one): it loads the dataset itself (the plan does not read its files).
LOADED_CARD = (
    "---\nlicense: odc-by\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
    "    path: data/*\n  encoding: utf-8-sig\n---\n# chats the datasets library loads\n"
)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that went away mid-answer (a stopped run): not the test's business


class HubEmulator:
    """Serves ``root`` as dataset ``repo`` at :attr:`endpoint` (at one commit, named from its files)."""

    def __init__(self, root: Path, repo: str, rate: float | None = None) -> None:
        """``rate``: bytes a second each answer is sent at (a link's speed; loopback's own otherwise)."""
        self.root, self.repo, self.rate = root, repo, rate
        self.commit = hashlib.sha1("\n".join(self.files()).encode()).hexdigest()
        self.held: dict[str, threading.Event] = {}  # path -> set to let its whole download go
        self.failing: set[str] = set()  # paths whose whole download fails
        self.flaky: dict[str, int] = {}  # path -> whole downloads still answered 503 (too busy)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, range)
        self.served: list[str] = []  # files served whole, as each was sent
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", free_port()), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubEmulator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for event in self.held.values():
            event.set()
        self._server.shutdown()
        self._server.server_close()

    def whole_downloads(self, path: str) -> int:
        """How many times ``path`` was sent whole (not a range)."""
        with self._lock:
            return self.served.count(path)

    def files(self) -> list[str]:
        """The repository's files (paths in it), sorted."""
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def _entry(self, path: str) -> dict:
        full = self.root / path
        if full.is_dir():
            return {"type": "directory", "path": path, "oid": self.commit}
        return {"type": "file", "path": path, "size": full.stat().st_size, "oid": _oid(full)}

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self._head(code, len(body), headers)
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _head(self, code: int, length: int, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def _json(self, obj: object) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _serve(self) -> None:
                url = urllib.parse.urlparse(self.path)
                path = urllib.parse.unquote(url.path)
                with hub._lock:
                    hub.requests.append((self.command, path, self.headers.get("Range")))
                api = f"/api/datasets/{hub.repo}"
                if path in (api, f"{api}/revision/main", f"{api}/revision/{hub.commit}"):
                    return self._json(
                        {
                            "id": hub.repo,
                            "sha": hub.commit,
                            "private": False,
                            "disabled": False,
                            "gated": False,
                            "lastModified": "2026-01-01T00:00:00.000Z",
                            "siblings": [{"rfilename": f} for f in hub.files()],
                            "tags": [],
                        }
                    )
                if m := re.fullmatch(rf"{re.escape(api)}/tree/[^/]+/?(.*)", path):
                    return self._tree(m.group(1).strip("/"), "recursive=true" in url.query.lower())
                if re.fullmatch(rf"{re.escape(api)}/paths-info/[^/]+", path):
                    body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                    wanted = urllib.parse.parse_qs(body).get("paths", [])
                    return self._json([hub._entry(p) for p in wanted if (hub.root / p).exists()])
                if m := re.fullmatch(rf"/datasets/{re.escape(hub.repo)}/resolve/[^/]+/(.+)", path):
                    return self._file(m.group(1))
                self._send(404, headers={"X-Error-Code": "EntryNotFound"})

            def _tree(self, under: str, recursive: bool) -> None:
                base = hub.root / under
                if not base.is_dir():
                    return self._send(404, headers={"X-Error-Code": "EntryNotFound"})
                found = base.rglob("*") if recursive else base.iterdir()
                self._json([hub._entry(p.relative_to(hub.root).as_posix()) for p in sorted(found)])

            def _file(self, name: str) -> None:
                full = hub.root / name
                if not full.is_file():
                    return self._send(404, headers={"X-Error-Code": "EntryNotFound"})
                asked = self.headers.get("Range")
                if self.command == "GET" and asked is None:
                    if name in hub.failing:
                        return self._send(403, b"forbidden by the test")
                    with hub._lock:
                        busy = hub.flaky.get(name, 0)
                        if busy:
                            hub.flaky[name] = busy - 1
                    if busy:
                        return self._send(503, b"the hub is too busy (the test's word)")
                    if (held := hub.held.get(name)) is not None:
                        held.wait(60)
                size = full.stat().st_size
                headers = {"X-Repo-Commit": hub.commit, "ETag": f'"{_oid(full)}"', "Accept-Ranges": "bytes"}
                start, end, code = 0, size - 1, 200
                if asked is not None:
                    lo, _, hi = asked.removeprefix("bytes=").partition("-")
                    start = int(lo) if lo else size - int(hi)
                    end = min(int(hi), size - 1) if lo and hi else size - 1
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
                    code = 206
                self._head(code, end + 1 - start, headers)
                if self.command == "HEAD":
                    return
                with open(full, "rb") as fh:
                    fh.seek(start)
                    sent, began = 0, time.monotonic()
                    while sent < end + 1 - start:
                        block = fh.read(min(1 << 20, end + 1 - start - sent))
                        self.wfile.write(block)
                        sent += len(block)
                        if hub.rate is not None:  # (a link's speed)
                            time.sleep(max(0.0, began + sent / hub.rate - time.monotonic()))
                if asked is None:
                    with hub._lock:
                        hub.served.append(name)

            do_GET = do_HEAD = do_POST = _serve

        return Handler


@functools.lru_cache(maxsize=1024)
def _oid_of(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _oid(path: Path) -> str:
    stat = path.stat()
    return _oid_of(path, stat.st_size, stat.st_mtime_ns)


def without_hub_settings() -> dict[str, str]:
    """This process's environment without the hub's settings (``HF_*``): a test's own hub and cache only."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}


def hub_environment(hub: HubEmulator, home: Path) -> dict[str, str]:
    """The environment of a process that reaches ``hub`` (and only it), with its own hub cache."""
    env = without_hub_settings()
    return {**env, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
