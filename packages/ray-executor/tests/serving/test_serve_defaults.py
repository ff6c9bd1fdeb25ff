"""The README's `pipejax serve -dp 2 -pp 2 -dpb ray` with default settings on the default model (SmolLM2),
one local Ray cluster started by the server: both engines start without Ray's memory monitor killing
either (each sizes its KV cache from its share of the host's CPU budget), and a completion comes back.

Slow (~2 min on 2 cores: four stage actors load and compile), so it runs in `nox -s serve_defaults`, not
in the default `ray_executor` session.
"""

import threading

import httpx2 as httpx
import psutil
import pytest
from server_utils import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GIB = 1 << 30


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it (Ray's own and the actors included)."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def test_readme_serve_dp2_pp2_ray_with_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the server starts its own local cluster, as in the README
    server = Server(["-dp", "2", "-pp", "2", "-dpb", "ray"], tmp_path / "serve.log")
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], tree_rss(server.proc.pid))
            except psutil.Error:
                return
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        server.wait_healthy(timeout=600)
        resp = httpx.post(f"{server.url}/v1/completions", timeout=300,
                          json={"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"].strip() and choice["finish_reason"] == "length", choice
        log = server.tail(200)
        # each engine's one KV line: two engines of two stages share this host's budget
        assert log.count("shared by 4 stages on this host (2 engines x 2)") == 2, log
        print(f"peak RSS of the server's process tree: {peak[0] / GIB:.2f} GiB")
        assert peak[0] < 16 * GIB, f"peak RSS {peak[0] / GIB:.2f} GiB"
    finally:
        stop.set()
        sampler.join(timeout=5)
        rc = server.stop()
        print(server.tail())
    assert rc == 0, f"server exit code {rc}"
