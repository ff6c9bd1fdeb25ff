"""A Ray cluster of "real hosts" on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace (``<prefix>-h<i>``) with its own address on a private test
range, its own hostname (a UTS namespace: ``unshare --uts``), a ``resolv.conf`` that fails fast
and a ``hosts`` file naming itself. A veth pair joins each namespace to a bridge in the root
namespace (the bridge has no address: nothing changes for the machine's own networking). Host 0
runs the Ray head, the others Ray worker nodes, each with its own ``--temp-dir``, a capped object
store and the CPU device resource the Ray executor places stages on.

    with NetnsCluster([HostSpec("10.213.0.50", 2), HostSpec("10.213.0.100", 2)]) as cluster:
        proc = cluster.popen(0, [sys.executable, "driver.py"], env={"RAY_ADDRESS": cluster.address})
        cluster.kill_host(1)  # cut its link, SIGKILL every process in it

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2. Never uses ``ray stop`` (it would stop
every Ray process on the machine, in every namespace): nodes are stopped by PID, found with
``ip netns pids``. Everything is torn down on exit, and leftovers of a crashed run with the same
prefix are removed on entry; a lock file keeps two runs with one prefix from meeting.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

CPU_DEVICE_RESOURCE = "pipejax_cpu_device"  # pipejax.ray_executor.executor.ray_placement.CPU_DEVICE_RESOURCE
DEFAULT_SUBNET = "10.213.0.0/24"  # a private range; only the addresses the caller assigns are used
HEAD_PORT = 6379
# Fast node-death detection (the defaults take ~64 s for a host that went silent).
HEAD_HEALTH_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
# sethostname in the new UTS namespace, then exec the command: hosts get their own names.
_SET_HOSTNAME = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no iproute2, no CAP_SYS_ADMIN, ...)."""


@dataclasses.dataclass(frozen=True)
class HostSpec:
    ip: str
    devices: int  # how many pipejax_cpu_device the node declares


@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    name: str  # the namespace, and the host's hostname
    ip: str
    devices: int
    veth: str  # root-namespace end of its veth pair (the namespace end is eth0)
    temp_dir: Path


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def ensure_iproute2() -> None:
    """`ip` is needed; on a fresh machine (CI runs as root) install iproute2 with apt."""
    if shutil.which("ip"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise NetnsUnavailable("`ip` (iproute2) is missing and cannot be installed here (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "iproute2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise NetnsUnavailable(f"installing iproute2 failed: {' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
    if not shutil.which("ip"):
        raise NetnsUnavailable("iproute2 installed but `ip` is still not on PATH")


def check_available(prefix: str = "pj") -> None:
    """Raise ``NetnsUnavailable`` with the reason unless namespaces, veths and bridges can be made."""
    if sys.platform != "linux":
        raise NetnsUnavailable(f"network namespaces need Linux, not {sys.platform}")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (CI runs as root)")
    ensure_iproute2()
    if not shutil.which("unshare"):
        raise NetnsUnavailable("`unshare` (util-linux) is missing")
    probe, bridge = f"{prefix}-probe", f"{prefix}-brprobe"
    _run("ip", "netns", "del", probe, check=False)
    _run("ip", "link", "del", bridge, check=False)
    try:
        for cmd in (("ip", "netns", "add", probe), ("ip", "link", "add", bridge, "type", "bridge")):
            proc = _run(*cmd, check=False)
            if proc.returncode != 0:
                raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    finally:
        _run("ip", "link", "del", bridge, check=False)
        _run("ip", "netns", "del", probe, check=False)


def netns_pids(ns: str) -> list[int]:
    proc = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []


def kill_netns_processes(namespaces: Sequence[str], grace_s: float = 2.0) -> int:
    """Every process in ``namespaces``: SIGTERM, then SIGKILL what is left after ``grace_s`` (0:
    SIGKILL at once), until none is left (a dying raylet may still spawn a worker). Returns how
    many processes it signalled."""
    signalled: set[int] = set()

    def alive() -> list[int]:
        return [p for ns in namespaces for p in netns_pids(ns) if p != os.getpid()]

    def send(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            signalled.add(pid)

    if grace_s > 0 and (pids := alive()):
        send(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    deadline = time.monotonic() + 15.0
    while pids := alive():
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespaces {list(namespaces)} survive SIGKILL")
        send(pids, signal.SIGKILL)
        time.sleep(0.05)
    return len(signalled)


class NetnsCluster:
    """Context manager: namespaces + bridge + Ray head/workers; ``address`` is the head's GCS address."""

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        *,
        prefix: str = "pj",
        subnet: str = DEFAULT_SUBNET,
        python: str = sys.executable,
        object_store_bytes: int = 100 * 1024 * 1024,
        start_timeout_s: float = 120.0,
        base_dir: str | None = None,
        log=None,
    ):
        if not hosts:
            raise ValueError("a cluster needs at least the head host")
        net = ipaddress.ip_network(subnet)
        ips = [h.ip for h in hosts]
        if len(set(ips)) != len(ips):
            raise ValueError(f"host addresses must differ: {ips}")
        for ip in ips:
            addr = ipaddress.ip_address(ip)
            if addr not in net or addr in (net.network_address, net.broadcast_address):
                raise ValueError(f"{ip} is not a host address of the test range {subnet}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", prefix):
            raise ValueError(f"prefix {prefix!r}: 1-6 lowercase letters/digits (interface names are short)")
        self.prefix = prefix
        self.prefixlen = net.prefixlen
        self.python = python
        self.ray = str(Path(python).parent / "ray")
        self.object_store_bytes = object_store_bytes
        self.start_timeout_s = start_timeout_s
        # Short fixed paths: Ray's unix sockets live under the temp dir (a 107-character limit).
        self.base_dir = Path(base_dir or f"/tmp/pipejax-netns-{prefix}")
        self.bridge = f"{prefix}-br0"
        self.hosts = [
            Host(i, f"{prefix}-h{i}", h.ip, h.devices, f"{prefix}-v{i}", self.base_dir / f"h{i}")
            for i, h in enumerate(hosts)
        ]
        self.address = f"{self.hosts[0].ip}:{HEAD_PORT}"
        self._lock_file = None
        self._log = log or (lambda msg: print(f"[netns] {msg}", file=sys.stderr, flush=True))
        self.timings: dict[str, float] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        check_available(self.prefix)
        self._lock_file = open(f"/tmp/pipejax-netns-{self.prefix}.lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise RuntimeError(f"another netns cluster with prefix {self.prefix!r} runs on this machine") from None
        try:
            cleanup_leftovers(self.prefix, self.base_dir, log=self._log)
            t0 = time.monotonic()
            self._create_network()
            self.timings["network_s"] = time.monotonic() - t0
            self._start_ray()
            self.timings["ray_nodes_s"] = time.monotonic() - t0 - self.timings["network_s"]
        except BaseException:
            self._print_log_tails()
            self.teardown()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._print_log_tails()
        self.teardown()

    def teardown(self) -> None:
        """Stop every process in the namespaces by PID, delete namespaces, links, files. Idempotent."""
        try:
            cleanup_leftovers(self.prefix, self.base_dir, log=self._log, quiet=True)
        finally:
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None

    # --- network -----------------------------------------------------------------------------

    def _create_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for h in self.hosts:
            _run("ip", "netns", "add", h.name)
            _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
            _run("ip", "link", "set", h.veth, "master", self.bridge)
            _run("ip", "link", "set", h.veth, "up")
            _run("ip", "-n", h.name, "addr", "add", f"{h.ip}/{self.prefixlen}", "dev", "eth0")
            _run("ip", "-n", h.name, "link", "set", "eth0", "up")
            _run("ip", "-n", h.name, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / h.name
            etc.mkdir(parents=True, exist_ok=True)
            # Fail DNS fast (Ray's accelerator probing otherwise waits ~100 s on unreachable DNS).
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{h.ip} {h.name}\n")
            h.temp_dir.mkdir(parents=True, exist_ok=True)

    def exec_prefix(self, host: int) -> list[str]:
        """Run a command on ``host``: in its network namespace, under its own hostname."""
        name = self.hosts[host].name
        return ["ip", "netns", "exec", name, "unshare", "--uts", self.python, "-c", _SET_HOSTNAME, name]

    def popen(self, host: int, cmd: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` (a driver runs on host 0, the head's namespace)."""
        return subprocess.Popen([*self.exec_prefix(host), *cmd], env=self._env(env), **kwargs)

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTEST_CURRENT_TEST")}
        return {**env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **(extra or {})}

    # --- Ray -----------------------------------------------------------------------------------

    def _ray_start(self, h: Host) -> subprocess.Popen:
        cmd = [
            self.ray, "start",
            *(["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if h.index == 0
              else [f"--address={self.address}"]),
            f"--node-ip-address={h.ip}",
            f"--temp-dir={h.temp_dir}",
            f"--object-store-memory={self.object_store_bytes}",
            "--num-cpus=1",
            f"--resources={json.dumps({CPU_DEVICE_RESOURCE: h.devices})}",
            "--disable-usage-stats",
        ]  # fmt: skip
        out = open(self.base_dir / f"ray-start-h{h.index}.log", "w")  # a file: daemons inherit it, a pipe never ends
        with out:
            return self.popen(h.index, cmd, env=HEAD_HEALTH_ENV if h.index == 0 else None,
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_started(self, procs: dict[int, subprocess.Popen], deadline: float) -> None:
        for i, proc in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            if rc != 0:
                log = (self.base_dir / f"ray-start-h{i}.log").read_text(errors="replace")[-3000:]
                hint = ""
                if i > 0:
                    hint = (" (a worker that cannot reach the head: is bridged traffic filtered? "
                            "net.bridge.bridge-nf-call-iptables with a FORWARD DROP policy would do that)")
                host = self.hosts[i]
                raise RuntimeError(f"`ray start` on {host.name} ({host.ip}) failed: {rc}{hint}\n{log}")

    def _start_ray(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        t0 = time.monotonic()
        self._wait_started({0: self._ray_start(self.hosts[0])}, deadline)
        self.timings["head_s"] = time.monotonic() - t0
        self._wait_started({h.index: self._ray_start(h) for h in self.hosts[1:]}, deadline)
        self.wait_alive(deadline - time.monotonic())

    def wait_alive(self, timeout_s: float, hosts: Sequence[int] | None = None) -> list[dict]:
        """Until the nodes of ``hosts`` (default: every host) are alive in the head's GCS (asked from inside the
        head's namespace)."""
        probe = (
            "import json, sys, time, ray\n"
            "want = set(json.loads(sys.argv[1])); deadline = time.monotonic() + float(sys.argv[2])\n"
            "ray.init(address=sys.argv[3], log_to_driver=False, logging_level='error')\n"
            "while True:\n"
            "    alive = {n['NodeManagerAddress']: n for n in ray.nodes() if n['Alive']}\n"
            "    if want <= set(alive) or time.monotonic() > deadline: break\n"
            "    time.sleep(0.2)\n"
            "print(json.dumps([{'ip': ip, 'node_id': n['NodeID'], 'resources': n['Resources']}\n"
            "                  for ip, n in alive.items()]))\n"
        )
        ips = [self.hosts[i].ip for i in (range(len(self.hosts)) if hosts is None else hosts)]
        proc = subprocess.run(
            [*self.exec_prefix(0), self.python, "-c", probe, json.dumps(ips), str(max(1.0, timeout_s)), self.address],
            capture_output=True, text=True, env=self._env(), timeout=timeout_s + 60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"asking the head for its nodes failed: {proc.stderr[-3000:]}")
        nodes = json.loads(proc.stdout.strip().splitlines()[-1])
        missing = set(ips) - {n["ip"] for n in nodes}
        if missing:
            raise RuntimeError(f"nodes {sorted(missing)} did not join the head at {self.address}; alive: {nodes}")
        return nodes

    # --- faults --------------------------------------------------------------------------------

    def kill_host(self, host: int, cut_link: bool = True) -> int:
        """Lose ``host``: unplug its link (so nothing it does reaches anyone), then SIGKILL every
        process in its namespace. Returns how many processes were killed."""
        if cut_link:
            self.cut_link(host)
        return kill_netns_processes([self.hosts[host].name], grace_s=0)

    def cut_link(self, host: int) -> None:
        """Unplug ``host``'s link, both ends: its processes live on, and nothing they do reaches anyone."""
        h = self.hosts[host]
        _run("ip", "link", "set", h.veth, "down")
        _run("ip", "-n", h.name, "link", "set", "eth0", "down")

    def rejoin_host(self, host: int, timeout_s: float = 90.0) -> None:
        """Bring a lost ``host`` back: its link up, a new Ray node started on it (what a restarted machine
        does), and alive in the head's GCS."""
        h = self.hosts[host]
        _run("ip", "link", "set", h.veth, "up")
        _run("ip", "-n", h.name, "link", "set", "eth0", "up")
        deadline = time.monotonic() + timeout_s
        self._wait_started({h.index: self._ray_start(h)}, deadline)
        self.wait_alive(max(1.0, deadline - time.monotonic()), [host])

    def host_by_ip(self, ip: str) -> Host:
        return next(h for h in self.hosts if h.ip == ip)

    def host_running(self, title: str) -> Host:
        """The worker host (never the head) with a process whose command line starts with ``title`` (a Ray
        actor's process title, e.g. "ray::StageActor"): what an operator finds with ``ps`` on each machine."""
        for h in self.hosts[1:]:
            for pid in netns_pids(h.name):
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                        return h
                except OSError:
                    continue
        raise LookupError(f"no worker host runs a process titled {title!r}")

    def _print_log_tails(self, chars: int = 1500) -> None:
        for h in self.hosts:
            logs = h.temp_dir / "session_latest" / "logs"
            for name in ("gcs_server.err", "raylet.err", "raylet.out"):
                path = logs / name
                if path.is_file():
                    text = path.read_text(errors="replace")[-chars:]
                    if text.strip():
                        self._log(f"--- {h.name} {name} (tail) ---\n{text}")


def cleanup_leftovers(prefix: str = "pj", base_dir: Path | None = None, log=None, quiet: bool = False) -> list[str]:
    """Remove everything a run with ``prefix`` may have left: processes in its namespaces (by PID),
    the namespaces, veths and bridge, /etc/netns files, Ray temp dirs. Returns what it removed."""
    log = log or (lambda msg: print(f"[netns] {msg}", file=sys.stderr, flush=True))
    removed: list[str] = []
    ns_re = re.compile(rf"^{re.escape(prefix)}-h\d+$")
    listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
    namespaces = sorted({line.split()[0] for line in listing if line.strip() and ns_re.match(line.split()[0])})
    if namespaces:
        n = kill_netns_processes(namespaces, grace_s=2.0 if quiet else 0)
        removed.append(f"{n} processes")
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    link_re = re.compile(rf"^{re.escape(prefix)}-(v\d+|br0)$")
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if link_re.match(name):
            _run("ip", "link", "del", name, check=False)
            removed.append(f"link {name}")
    etc = Path("/etc/netns")
    if etc.is_dir():
        for d in etc.iterdir():
            if ns_re.match(d.name):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
        try:
            etc.rmdir()  # only when empty
        except OSError:
            pass
    base = base_dir or Path(f"/tmp/pipejax-netns-{prefix}")
    if base.exists():
        shutil.rmtree(base, ignore_errors=True)
        removed.append(str(base))
    if removed and not quiet:
        log("removed leftovers of an earlier run: " + ", ".join(removed))
    return removed
