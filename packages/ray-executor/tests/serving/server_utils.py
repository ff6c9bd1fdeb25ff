"""Helpers for the serving tests: a simulated Ray cluster, and `pipejax serve` as a user runs it (a subprocess)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

from pipejax.ray_executor.executor.ray_placement import CPU_DEVICE_RESOURCE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(devices_per_node: list[int]):
    """Head node first; each node declares its simulated devices. The test process does not join it."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {CPU_DEVICE_RESOURCE: devices_per_node[0]}},
    )
    for devices in devices_per_node[1:]:
        cluster.add_node(num_cpus=1, resources={CPU_DEVICE_RESOURCE: devices})
    cluster.wait_for_nodes()
    return cluster


class Server:
    """`python -m pipejax.ray_executor.cli serve ARGS` with its output in ``log``; stopped with SIGTERM."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        self._file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipejax.ray_executor.cli", "serve", *args, "--port", str(self.port)],
            stdout=self._file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )

    def wait_healthy(self, timeout: float = 240.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                resp = httpx.get(f"{self.url}/health", timeout=2)
                if resp.status_code == 200:
                    return resp.json()
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy within {timeout}s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        if not self._file.closed:
            self._file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._file.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(args: list[str], log: Path, timeout: float = 300.0, env: dict[str, str] | None = None):
    """`pipejax serve ARGS` for a ``with`` block (a module fixture's body): healthy on entry; stopped on exit, its
    log's tail printed and its exit code checked."""
    server = Server(args, log, env=env)
    try:
        server.wait_healthy(timeout=timeout)
        yield server
    finally:
        rc = server.stop()
        print(server.tail())
        assert rc == 0, f"server exit code {rc}"
