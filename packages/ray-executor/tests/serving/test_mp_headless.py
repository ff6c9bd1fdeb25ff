"""Backend mp: a head with one local engine and two API server processes on one port, plus a --headless
node that contributes rank 1 through the fixed ports; losing the headless node is caught by the heartbeat."""

import asyncio
import os
import signal
import socket
import time

import httpx2 as httpx
import openai
import pytest
from server_utils import Server

pytestmark = pytest.mark.timeout(400)

ENGINE = ["--model", "builtin", "-pp", "1", "-tp", "1", "--num-kv-blocks", "128", "--max-num-seqs", "16", "--no-warmup"]


def free_port_range(count: int) -> int:
    """A base port whose next ``count`` ports are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no free port range")


def per_engine(metrics: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0.0) + float(line.split()[-1])
    return out


def test_headless_rank_api_server_processes_and_heartbeat(tmp_path):
    rpc = str(free_port_range(6))
    dp = ["-dpb", "mp", "-dp", "2", "-dpl", "1", "-dpp", rpc, "--api-server-count", "2"]
    head = Server([*ENGINE, *dp, "--heartbeat-timeout", "3"], tmp_path / "head.log")
    headless = Server([*ENGINE, *dp, "--headless", "-dpr", "1"], tmp_path / "headless.log")
    try:
        body = head.wait_healthy(timeout=240)
        assert [e["alive"] for e in body["engines"]] == [True, True]
        engine1_pid = body["engines"][1]["pid"]

        async def burst():
            client = openai.AsyncOpenAI(base_url=f"{head.url}/v1", api_key="none", max_retries=0, timeout=120)
            return await asyncio.gather(*[
                client.completions.create(model="builtin", prompt=f"mp {i}", max_tokens=4, temperature=0)
                for i in range(40)
            ])

        outs = asyncio.run(burst())
        assert all(o.usage.completion_tokens == 4 for o in outs)
        served = {httpx.get(f"{head.url}/health", timeout=10).json()["api_server"] for _ in range(30)}
        assert served == {0, 1}  # both API server processes answer on the one port
        metrics = httpx.get(f"{head.url}/metrics", timeout=10).text  # summed over both processes
        done = per_engine(metrics, "pipejax:request_success_total")
        assert done.get("0", 0) > 0 and done.get("1", 0) > 0 and sum(done.values()) >= 40, done

        # The headless node goes away without a word: its launcher and engine process are killed.
        os.kill(engine1_pid, signal.SIGKILL)
        os.kill(headless.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            resp = httpx.get(f"{head.url}/health", timeout=10)
            if resp.status_code == 503:
                break
            time.sleep(0.5)
        assert resp.status_code == 503
        assert "data-parallel engine 1" in resp.json()["error"] and "no heartbeat" in resp.json()["error"]
        client = openai.OpenAI(base_url=f"{head.url}/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(4):  # whichever API server answers, engine 0 serves
            assert client.completions.create(model="builtin", prompt="still", max_tokens=2).usage.completion_tokens == 2
    finally:
        headless.stop()
        rc = head.stop()
        print(head.tail())
    assert rc == 0


def test_an_engine_with_ray_stage_actors_stops_cleanly_on_sigterm(tmp_path):
    """ray.init in the engine process installs Ray's own SIGTERM handler (sys.exit from wherever the main thread
    is); the engine's handler must win, so stopping the server ends the engine process itself, exit code 0 (it
    had died with -6, an abort)."""
    args = ["--model", "builtin", "-pp", "2", "-tp", "1", "--distributed-executor-backend", "ray", "-dpb", "mp",
            "--num-kv-blocks", "64", "--max-num-seqs", "4", "--no-warmup"]
    server = Server(args, tmp_path / "serve.log")
    try:
        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        assert client.completions.create(model="builtin", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        rc = server.stop()
    log = server.log.read_text(errors="replace")
    assert rc == 0, log[-3000:]
    assert "engine 0 ended" in log, log[-3000:]  # run_engine_process returned: the loop saw the stop
    assert "exited with code -" not in log and "SIGTERM received" not in log, log[-3000:]
