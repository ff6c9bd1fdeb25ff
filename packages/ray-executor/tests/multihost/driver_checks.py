"""Shared by the multi-host driver scripts: named pass/fail checks, and the handoff with the orchestrator.

A driver runs inside the head's namespace and cannot touch the other hosts: it asks the orchestrator (the test,
outside) with ``ask``, which writes ``action-<n>.json`` ({"action": "lose" | "join", "ip", ...}) and waits for
``done-<n>.json`` ({"time": time.time() when the orchestrator began}).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

_asked = itertools.count()


class Checks:
    """Records each named check (and a note for failures) and prints it as it happens."""

    def __init__(self, label: str):
        self.label = label
        self.results: dict[str, bool] = {}
        self.notes: dict[str, str] = {}

    def __call__(self, name: str, ok: bool, note: str = "") -> bool:
        self.results[name] = bool(ok)
        if note or not ok:
            self.notes[name] = note
        print(f"[{self.label}] {'ok  ' if ok else 'FAIL'} {name} {note}", flush=True)
        return ok


def write_atomically(path: Path, data: dict) -> None:
    """The test side polls these files: it must never read a half-written one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def ask(workdir: Path, action: str, timeout_s: float = 180, **data) -> float | None:
    """Ask the orchestrator to ``lose`` (cut the link, kill every process), ``cut`` (the link alone: its processes
    live on, unreachable) or ``join`` (bring back, start its Ray node) the host ``data["ip"]``; the time.time()
    at which it began, None if it did not answer in time."""
    done = ask_for(workdir, action, timeout_s, **data)
    return done["time"] if done else None


def ask_for(workdir: Path, action: str, timeout_s: float = 180, **data) -> dict | None:
    """``ask``, returning the orchestrator's whole answer ({"time", "ip", "host"}); ``data`` may name the host by
    ``ip``, or by ``running``: a process title that runs there (a worker host, never the head)."""
    n = next(_asked)
    write_atomically(workdir / f"action-{n}.json", {"action": action, **data})
    done = workdir / f"done-{n}.json"
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return json.loads(done.read_text())


def request(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            status, body = request(f"{base}/health", timeout=5)
            if status == 200:
                return body
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server was not healthy within {timeout_s:.0f}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(server: subprocess.Popen | None) -> float | None:
    """SIGTERM a server this driver started, SIGKILL it after 60 s; the seconds it took (None: not running)."""
    if server is None or server.poll() is not None:
        return None
    t0 = time.monotonic()
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=10)
    return round(time.monotonic() - t0, 1)
