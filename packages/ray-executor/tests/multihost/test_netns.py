"""The Ray executor across "real hosts": Ray nodes in Linux network namespaces, each with its own IP.

Three namespaces on a bridge (netns_cluster.py): the head pj-h0 (10.213.0.50) and two workers
created in the order pj-h1 (10.213.0.100), pj-h2 (10.213.0.9), each declaring 2 CPU devices. The
driver (run_multihost.py) runs inside pj-h0 and serves pp=3 x tp=2: the ranks must come out
pj-h0 (the driver's node), pj-h2, pj-h1 (then by IP, numerically: .9 before .100, which neither
creation order nor string order gives). Outputs must equal the in-process executor's. Then the
host of stage 1 is lost (link cut, every process killed by PID) while requests are in flight, and
the engine must raise an error naming stage 1 and its host within 30 s. Needs root; run by the
nox session ``multihost``; skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from netns_cluster import HostSpec, NetnsCluster, NetnsUnavailable, check_available  # noqa: E402

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).parent
PREFIX = "pj"
HOSTS = [HostSpec("10.213.0.50", 2), HostSpec("10.213.0.100", 2), HostSpec("10.213.0.9", 2)]
EXPECT_ORDER = ["pj-h0", "pj-h2", "pj-h1"]
VICTIM_RANK = 1  # on pj-h2: a middle stage (it receives and sends activations)
DRIVER_TIMEOUT_S = 420


@pytest.fixture
def teardown_on_sigterm():
    """A cancelled job (SIGTERM) unwinds through the cluster's teardown instead of dying in place."""

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def netns_available():
    try:
        check_available(PREFIX)
    except NetnsUnavailable as exc:
        pytest.skip(f"the multi-host test needs Linux network namespaces: {exc}")


def write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def leftovers() -> list[str]:
    """Anything of this test still on the machine: namespaces, links, files, processes."""
    found = [f"netns {line.split()[0]}" for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line.startswith(f"{PREFIX}-h")]
    for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"{PREFIX}-"):
            found.append(f"link {name}")
    found += [str(p) for p in Path("/etc/netns").glob(f"{PREFIX}-h*")] if Path("/etc/netns").is_dir() else []
    if Path(f"/tmp/pipejax-netns-{PREFIX}").exists():
        found.append(f"/tmp/pipejax-netns-{PREFIX}")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if f"/tmp/pipejax-netns-{PREFIX}/".encode() in cmdline:  # every Ray process names its temp dir
                args = cmdline.replace(b"\0", b" ")[:120].decode(errors="replace")
                found.append(f"process {proc.name}: {args}")
    return found


def test_engine_across_namespace_hosts(netns_available, teardown_on_sigterm, tmp_path):
    start = time.monotonic()
    log_path = tmp_path / "driver.log"
    kill_request, killed = tmp_path / "kill_request.json", tmp_path / "killed.json"
    kill: dict = {}
    with NetnsCluster(HOSTS, prefix=PREFIX) as cluster:
        cluster_up_s = time.monotonic() - start
        hosts = [{"name": h.name, "ip": h.ip, "devices": h.devices} for h in cluster.hosts]
        cmd = [
            sys.executable, str(HERE / "run_multihost.py"),
            "--hosts", json.dumps(hosts), "--workdir", str(tmp_path), "--pp", "3", "--tp", "2",
            "--expect-order", ",".join(EXPECT_ORDER), "--victim-rank", str(VICTIM_RANK),
        ]  # fmt: skip
        with open(log_path, "w") as log:
            driver = cluster.popen(0, cmd, env={"RAY_ADDRESS": cluster.address}, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + DRIVER_TIMEOUT_S
            while driver.poll() is None and not kill_request.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if kill_request.exists():
                request = json.loads(kill_request.read_text())
                victim = cluster.host_by_ip(request["ip"])
                assert victim.index != 0, f"the driver asked to kill the head host: {request}"
                killed_at = time.time()
                processes = cluster.kill_host(victim.index, cut_link=True)
                write_atomically(killed, {"time": killed_at, "processes": processes})
                kill = {"host": victim.name, "processes": processes, "kill_s": round(time.time() - killed_at, 3)}
            driver.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # reported below; the teardown kills it with everything else in the namespace
        finally:
            rc = driver.poll()
        teardown_start = time.monotonic()
    teardown_s = time.monotonic() - teardown_start
    log_text = log_path.read_text(errors="replace")
    summary_path = tmp_path / "summary.json"
    assert summary_path.exists(), f"the driver wrote no summary (rc {rc}); its log:\n{log_text[-8000:]}"
    summary = json.loads(summary_path.read_text())
    report = {
        "total_s": round(time.monotonic() - start, 1),
        "cluster_up_s": round(cluster_up_s, 1),
        "cluster": {k: round(v, 1) for k, v in cluster.timings.items()},
        "driver": summary["timings"],
        "teardown_s": round(teardown_s, 1),
        "rank_hosts": summary.get("rank_hosts"),
        "kill": kill,
        "error": summary.get("error"),
    }
    print("multihost:", json.dumps(report))
    failed = {k: summary["notes"].get(k, "") for k, ok in summary["checks"].items() if not ok}
    assert rc == 0 and summary["ok"], f"failed checks: {failed} (rc {rc}); driver log:\n{log_text[-8000:]}"
    assert summary["checks"].get("a lost host raises EngineDeadError"), "the lost-host phase did not run"
    assert summary["rank_hosts"] == EXPECT_ORDER
    assert not leftovers(), f"teardown left: {leftovers()}"
