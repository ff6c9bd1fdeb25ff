"""Soak: `pipejax serve` under steady load; engine and stage RSS must stay flat after warm-up.

Starts `pipejax serve` (default: the built-in random model, pp=2 on the Ray executor, so the stages are
Ray actors), keeps ``--concurrency`` clients sending completions through the OpenAI endpoint for
``--minutes``, and samples the resident memory of every process of the server by PID from /proc (the
API server, the engine core, each stage actor; Ray's own daemons are left out). Growth is the median
RSS of the last minute minus the median of the first minute after ``--warmup-minutes``; it passes when
every process grew by less than ``--limit-mb``.

    python packages/ray-executor/benchmarks/soak.py --minutes 20        # or: nox -s soak
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx2 as httpx

PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children by /proc/*/stat's ppid)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def role(pid: int, root: int) -> str | None:
    """What a server process is: "api", "engine", "stage"; None for Ray's daemons and helpers."""
    if pid == root:
        return "api"
    cmd = cmdline(pid)
    if "StageActor" in cmd:
        return "stage"
    if "multiprocessing.spawn" in cmd or "EngineCoreActor" in cmd:
        return "engine"
    return None


def load(url: str, model: str, stop: threading.Event, counts: list[int], input_len: int, output_len: int) -> None:
    prompt = [1 + (i * 7) % 300 for i in range(input_len)]  # within the built-in model's 320-token vocabulary
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                    "temperature": 0.8}
            resp = client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200 and not stop.is_set():  # (the server stopping after the run is no failure)
                raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.text[:500]}")
            counts[0] += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--warmup-minutes", type=float, default=3.0, help="not counted (first compiles, pools filling)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--limit-mb", type=float, default=20.0)
    p.add_argument("--output-json", default=None)
    p.add_argument("serve_args", nargs="*", default=None,
                   help="`pipejax serve` arguments (default: --model builtin -pp 2 --distributed-executor-backend ray)")
    args = p.parse_args()
    serve_args = args.serve_args or ["--model", "builtin", "-pp", "2", "--distributed-executor-backend", "ray"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    server = subprocess.Popen([sys.executable, "-m", "pipejax.ray_executor.cli", "serve", *serve_args,
                               "--port", str(port)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                raise SystemExit(f"`pipejax serve` exited with {server.returncode} before it was healthy")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("`pipejax serve` was not healthy within 900 s")
            time.sleep(2)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        stop, counts = threading.Event(), [0]
        clients = [threading.Thread(target=load, args=(url, model, stop, counts, args.input_len, args.output_len),
                                    daemon=True) for _ in range(args.concurrency)]
        for t in clients:
            t.start()
        samples: dict[int, list[tuple[float, int]]] = {}
        roles: dict[int, str] = {}
        start, started_at = time.monotonic(), time.time()
        while (elapsed := time.monotonic() - start) < args.minutes * 60:
            for pid in [server.pid, *descendants(server.pid)]:
                kind = roles.get(pid) or role(pid, server.pid)
                if kind and (rss := rss_bytes(pid)) is not None:
                    roles[pid] = kind
                    samples.setdefault(pid, []).append((elapsed, rss))
            if not all(t.is_alive() for t in clients):
                raise SystemExit("a load client failed (see its traceback above)")
            print(f"{elapsed / 60:5.1f} min  {counts[0]} requests  "
                  + "  ".join(f"{roles[pid]}:{pid} {s[-1][1] / 2**20:.0f}MB" for pid, s in samples.items()),
                  flush=True)
            time.sleep(args.interval)
        stop.set()
        stages = [pid for pid, kind in roles.items() if kind == "stage"]
        return report(samples, roles, args, counts[0], serve_args, stage_compiles(stages, started_at))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def stage_compiles(pids: list[int], started_at: float) -> list[float] | None:
    """Seconds after the load started (negative: before) at which a stage compiled a step shape, read from
    the "compiling step for" lines in the stage actors' Ray worker logs (None when no log was found)."""
    import datetime
    import glob

    root = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray")
    files = [f for pid in pids for f in glob.glob(os.path.join(root, "session_*", "logs", f"worker-*-{pid}.err"))]
    if not files:
        return None
    times = []
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                if "compiling step for" in line:
                    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                    times.append(stamp.timestamp() - started_at)
    return sorted(times)


def report(samples, roles, args, requests: int, serve_args: list[str], compiles: list[float] | None) -> int:
    warm, end = args.warmup_minutes * 60, args.minutes * 60
    rows = []
    for pid, series in samples.items():
        first = [rss for t, rss in series if warm <= t < warm + 60]
        last = [rss for t, rss in series if t >= end - 60]
        if first and last:
            growth = (statistics.median(last) - statistics.median(first)) / 2**20
            rows.append({"role": roles[pid], "pid": pid, "rss_mb": statistics.median(last) / 2**20,
                         "growth_mb": growth})
    ok = bool(rows) and all(r["growth_mb"] < args.limit_mb for r in rows)
    print(f"\nsoak: {args.minutes:g} min, {requests} requests, concurrency {args.concurrency}, "
          f"serve {' '.join(serve_args)}; RSS growth after {args.warmup_minutes:g} min warm-up:")
    for r in sorted(rows, key=lambda r: (r["role"], r["pid"])):
        print(f"  {r['role']:6} pid {r['pid']:>7}: {r['rss_mb']:7.0f} MB, growth {r['growth_mb']:+6.1f} MB")
    late = [t for t in compiles or [] if t >= warm]
    if compiles is not None:  # a compiled step shape costs its stage memory: the likeliest growth after warm-up
        print(f"  step shapes compiled (all stages): {len(compiles) - len(late)} before the end of warm-up, "
              f"{len(late)} after" + (f" (at {', '.join(f'{t / 60:.1f}' for t in late)} min)" if late else ""))
    print(f"{'PASS' if ok else 'FAIL'}: every process grew < {args.limit_mb:g} MB" if rows else "FAIL: no samples")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"minutes": args.minutes, "requests": requests, "processes": rows, "pass": ok,
                       "compiles_after_warmup_min": [t / 60 for t in late]}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
