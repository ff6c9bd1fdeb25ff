"""`pipejax serve`'s life as a supervisor sees it: once no engine can serve (recovery off here, so nothing is
rebuilt), the server stops by itself and exits with status 3, so that systemd or Kubernetes restarts it."""

import os
import signal

import pytest
from server_utils import Server, start_cluster

pytestmark = pytest.mark.timeout(300)


def test_a_server_left_without_engines_exits_with_status_3(tmp_path):
    cluster = start_cluster([1])
    server = Server(["--model", "builtin", "-dp", "1", "-pp", "1", "-dpb", "ray", "--recovery", "off",
                     "--num-kv-blocks", "64", "--no-warmup"], tmp_path / "serve.log",
                    env={"RAY_ADDRESS": cluster.address})
    try:
        body = server.wait_healthy(timeout=180)
        os.kill(body["engines"][0]["pid"], signal.SIGKILL)  # the engine-core actor this test's server started
        rc = server.proc.wait(timeout=60)
        assert rc == 3, f"exit status {rc}:\n{server.tail()}"
        assert "no data-parallel engine can serve" in server.tail()
    finally:
        server.stop()
        cluster.shutdown()
