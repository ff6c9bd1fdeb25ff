"""The Ray executor across "real hosts": Ray nodes in Linux network namespaces, each with its own IP.

Three namespaces on a bridge (netns_cluster.py): the head pj-h0 (10.213.0.50) and two workers
created in the order pj-h1 (10.213.0.100), pj-h2 (10.213.0.9), each declaring 2 CPU devices. The
driver (run_multihost.py) runs inside pj-h0 and serves pp=3 x tp=2: the ranks must come out
pj-h0 (the driver's node), pj-h2, pj-h1 (then by IP, numerically: .9 before .100, which neither
creation order nor string order gives). Outputs must equal the in-process executor's. Then the
host of stage 1 is lost (link cut, every process killed by PID) while requests are in flight, and
the engine (no host spare) must raise an error naming stage 1, its host and that no node could take it
within its recovery timeout (15 s) + 30 s. A second test runs pp=2 x tp=2 on the same hosts, one of them
spare, and loses the host of stage 1: the stage must move to the spare and every request finish as without
the loss. A third serves through ``pipejax serve`` and the openai client (run_serve_heal.py): streams through
a lost stage host, then no spare (requests fail by name, the server waits), then a host comes back and the same
server serves again. Needs root; run by the nox session ``multihost``; skipped with the reason where namespaces
cannot be made.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from driver_checks import write_atomically  # noqa: E402
from netns_cluster import HostSpec, NetnsCluster, NetnsUnavailable, check_available  # noqa: E402

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).parent
SCHEDULE_BENCH = HERE.resolve().parents[3] / "benchmarks" / "pipeline_schedule.py"  # the repository root's
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
    run_and_check(tmp_path, HOSTS, pp=3, tp=2, expect_order=EXPECT_ORDER, victim_rank=VICTIM_RANK)


def test_batches_in_flight_fill_simulated_stages(netns_available, teardown_on_sigterm, tmp_path):
    """The schedule benchmark (benchmarks/pipeline_schedule.py) as its README line runs it, on two namespace hosts
    (its own prefix), plain and compiled graph: every step of the 20 ms simulated stages took its set time, and two
    batches in flight give well over one batch's output rate (the pipeline overlaps its stages across hosts)."""
    out = tmp_path / "schedule.json"
    proc = subprocess.run([sys.executable, str(SCHEDULE_BENCH), "--pp", "2", "--repeats", "1", "--output-len", "16",
                           "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads(out.read_text())["summary"]
    assert sorted(r["mode"] for r in summary) == ["compiled", "plain"]
    for r in summary:
        assert r["stage_ms"] >= 20, r
        assert 0 <= r["bubble_pp"] < 0.5, r
        assert r["tok_s_pp"] >= 1.3 * r["tok_s_1"], r  # ideal: 2x


@pytest.mark.extra  # the default run heals through `pipejax serve` (below); this one cuts the link alone
def test_a_lost_host_heals_onto_a_spare(netns_available, teardown_on_sigterm, tmp_path):
    """pp=2 x tp=2 over three namespace hosts of 2 devices: stage 0 on the head, stage 1 on one worker, the
    other worker spare. With 8 requests in flight the host of stage 1 is cut off (its link alone: its processes
    live on, unreachable, so only the pings can find it): the engine moves the stage to the spare and every
    request finishes as without the loss."""
    run_and_check(tmp_path, HOSTS, pp=2, tp=2, expect_order=[], victim_rank=1, extra_args=["--spare", "--cut-only"],
                  healed=True)


@pytest.mark.extra
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled-graph"])
def test_stage0_host_lost_heals_onto_a_spare(netns_available, teardown_on_sigterm, tmp_path, compiled):
    """A head without devices (the driver alone) and three workers of 2 devices, pp=2 x tp=2: stage 0's host is
    lost with 8 requests in flight, the stage moves to the spare worker, every request finishes as without the
    loss; in plain and compiled-graph mode. (``nox -s multihost_extra``)"""
    hosts = [HostSpec("10.213.0.50", 0), HostSpec("10.213.0.100", 2), HostSpec("10.213.0.9", 2),
             HostSpec("10.213.0.77", 2)]
    run_and_check(tmp_path, hosts, pp=2, tp=2, expect_order=[], victim_rank=0, healed=True,
                  extra_args=["--spare", *(["--ray-compiled-graph"] if compiled else [])])


@pytest.mark.extra
def test_compiled_graph_with_several_stages_per_host(netns_available, teardown_on_sigterm, tmp_path):
    """pp=4 x tp=1 over two namespace hosts of 2 devices (two stages each, ranks h0, h0, h1, h1), the
    stages in a Ray Compiled Graph; the host of stages 2 and 3 is lost with requests in flight: the
    error names stage 2 and its host within 30 s, as in plain mode. (``nox -s multihost_extra``)"""
    hosts = [HostSpec("10.213.0.50", 2), HostSpec("10.213.0.9", 2)]
    run_and_check(tmp_path, hosts, pp=4, tp=1, expect_order=["pj-h0", "pj-h0", "pj-h1", "pj-h1"], victim_rank=2,
                  extra_args=["--ray-compiled-graph"])


def run_and_check(tmp_path, host_specs, *, pp: int, tp: int, expect_order: list[str], victim_rank: int,
                  extra_args: tuple[str, ...] = (), healed: bool = False) -> None:
    start = time.monotonic()
    log_path = tmp_path / "driver.log"
    with NetnsCluster(host_specs, prefix=PREFIX) as cluster:
        cluster_up_s = time.monotonic() - start
        hosts = [{"name": h.name, "ip": h.ip, "devices": h.devices} for h in cluster.hosts]
        cmd = [
            sys.executable, str(HERE / "run_multihost.py"),
            "--hosts", json.dumps(hosts), "--workdir", str(tmp_path), "--pp", str(pp), "--tp", str(tp),
            *(["--expect-order", ",".join(expect_order)] if expect_order else []), "--victim-rank", str(victim_rank),
            *extra_args,
        ]  # fmt: skip
        rc, kill = drive(cluster, cmd, tmp_path, log_path)
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
        "healed_onto": summary.get("healed_onto"),
    }
    print("multihost:", json.dumps(report))
    failed = {k: summary["notes"].get(k, "") for k, ok in summary["checks"].items() if not ok}
    assert rc == 0 and summary["ok"], f"failed checks: {failed} (rc {rc}); driver log:\n{log_text[-8000:]}"
    if healed:
        assert summary["checks"].get("every request finished as without the loss"), "the healing phase did not run"
    else:
        assert summary["checks"].get("a lost host raises EngineDeadError"), "the lost-host phase did not run"
    if expect_order:
        assert summary["rank_hosts"] == expect_order
    assert not leftovers(), f"teardown left: {leftovers()}"


def drive(cluster: NetnsCluster, cmd: list[str], workdir, log_path) -> tuple[int | None, dict]:
    """Run a driver on the head host and carry out what it asks (``driver_checks.ask``): lose a host (never the
    head) or bring one back; return its exit status (None: still running at the deadline) and the first loss."""
    kill: dict = {}
    with open(log_path, "w") as log:
        driver = cluster.popen(0, cmd, env={"RAY_ADDRESS": cluster.address}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, n = time.monotonic() + DRIVER_TIMEOUT_S, 0
        while driver.poll() is None and time.monotonic() < deadline:
            request = workdir / f"action-{n}.json"
            if not request.exists():
                time.sleep(0.05)
                continue
            asked = json.loads(request.read_text())
            host = cluster.host_by_ip(asked["ip"]) if "ip" in asked else cluster.host_running(asked["running"])
            assert host.index != 0, f"the driver asked to touch the head host: {asked}"
            began = time.time()
            if asked["action"] in ("lose", "cut"):
                processes = cluster.kill_host(host.index, cut_link=True) if asked["action"] == "lose" else 0
                if asked["action"] == "cut":
                    cluster.cut_link(host.index)
                kill = kill or {"host": host.name, "processes": processes, "kill_s": round(time.time() - began, 3),
                                "how": asked["action"]}
            else:
                cluster.rejoin_host(host.index, timeout_s=90)
            write_atomically(workdir / f"done-{n}.json", {"time": began, "ip": host.ip, "host": host.name})
            n += 1
        driver.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported by the caller; the teardown kills it with everything else in the namespace
    return driver.poll(), kill


def test_serve_heals_a_lost_stage_host_then_waits_for_a_node_and_serves_again(netns_available, teardown_on_sigterm,
                                                                            tmp_path):
    """`pipejax serve -pp 2 -tp 2` on the three hosts, one spare, driven by the openai client (run_serve_heal.py):
    16 streams with stage 1's host lost at a random token heal onto the spare, each stream unbroken and equal to
    the clean run; with no spare left the requests fail by name, /health says degraded and the server stays up;
    once the lost host comes back the same server serves again."""
    log_path = tmp_path / "driver.log"
    with NetnsCluster(HOSTS, prefix=PREFIX) as cluster:
        hosts = [{"name": h.name, "ip": h.ip, "devices": h.devices} for h in cluster.hosts]
        cmd = [sys.executable, str(HERE / "run_serve_heal.py"), "--hosts", json.dumps(hosts),
               "--workdir", str(tmp_path)]
        rc, kill = drive(cluster, cmd, tmp_path, log_path)
    log_text = log_path.read_text(errors="replace")
    serve_log = (tmp_path / "serve.log").read_text(errors="replace") if (tmp_path / "serve.log").exists() else ""
    logs = f"driver log:\n{log_text[-6000:]}\nserve log:\n{serve_log[-8000:]}"
    summary_path = tmp_path / "summary.json"
    assert summary_path.exists(), f"no summary (rc {rc}); {logs}"
    summary = json.loads(summary_path.read_text())
    print("multihost serve heal:", json.dumps({k: summary.get(k) for k in ("timings", "seed", "tokens_before_loss",
                                                                           "first_lost")}))
    failed = {k: summary["notes"].get(k, "") for k, ok in summary["checks"].items() if not ok}
    assert rc == 0 and summary["ok"], f"failed: {failed} (rc {rc})\n{logs}"
    assert summary["checks"].get("after the host joined, the streams equal the clean run"), "phase 4 did not run"
    assert not leftovers(), f"teardown left: {leftovers()}"


@pytest.mark.extra
@pytest.mark.parametrize("dpl, lose", [(1, True), (0, False)], ids=["dpl1-host-lost", "dpl0-api-server-alone"])
def test_serve_data_parallel_engines_on_namespace_hosts(netns_available, teardown_on_sigterm, tmp_path, dpl, lose):
    """`pipejax serve -dp 2 -dpl N -dpb ray` with the API server on the head (pj-h0): -dpl 1 puts engine 1
    on pj-h1 (its own IP), whose loss must move engine 1's requests to engine 0, where they finish, with
    /health degraded, and whose return lets the head rebuild engine 1 there; -dpl 0 puts both engines on pj-h1.
    Outputs equal a single-host run. (multihost_extra)"""
    hosts = [HostSpec("10.213.0.50", 1), HostSpec("10.213.0.9", 1 if dpl else 2)]
    log_path = tmp_path / "driver.log"
    with NetnsCluster(hosts, prefix=PREFIX) as cluster:
        names = [{"name": h.name, "ip": h.ip, "devices": h.devices} for h in cluster.hosts]
        cmd = [sys.executable, str(HERE / "run_serve_multihost.py"), "--hosts", json.dumps(names),
               "--workdir", str(tmp_path), "--dpl", str(dpl), *(["--lose-host"] if lose else [])]
        rc, kill = drive(cluster, cmd, tmp_path, log_path)
    log_text = log_path.read_text(errors="replace")
    serve_log = (tmp_path / "serve.log").read_text(errors="replace") if (tmp_path / "serve.log").exists() else ""
    summary_path = tmp_path / "summary.json"
    logs = f"driver log:\n{log_text[-6000:]}\nserve log:\n{serve_log[-6000:]}"
    assert summary_path.exists(), f"no summary (rc {rc}); {logs}"
    summary = json.loads(summary_path.read_text())
    print("multihost serve:", json.dumps({"timings": summary["timings"], "engine_hosts": summary.get("engine_hosts"),
                                          "kill": kill}))
    failed = {k: summary["notes"].get(k, "") for k, ok in summary["checks"].items() if not ok}
    assert rc == 0 and summary["ok"], f"failed: {failed} (rc {rc})\n{logs}"
    assert not lose or summary["checks"].get("/health says degraded"), "the lost-host phase did not run"
    assert not leftovers(), f"teardown left: {leftovers()}"
