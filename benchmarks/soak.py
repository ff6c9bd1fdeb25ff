"""Soak: `pipejax serve` under steady load; engine and stage RSS must stay flat after warm-up.

Starts `pipejax serve` (default: the built-in random model, pp=2 on the Ray executor, so the stages are
Ray actors), keeps ``--concurrency`` clients sending completions through the OpenAI endpoint for
``--minutes``, and samples the resident memory of every process of the server by PID from /proc (the
API server, the engine core, each stage actor; Ray's own daemons are left out). Growth is the median
RSS of the last minute minus the median of the first minute after ``--warmup-minutes``; it passes when
every process grew by less than ``--limit-mb``.

    python benchmarks/soak.py --minutes 20        # or: nox -s soak

``--chaos-every-s 90`` makes it a chaos soak: a stage actor process is killed (SIGKILL) every 90 s, the load is
greedy streams whose text must equal a reference taken before the first kill, and it passes only when no
request failed or differed, every kill was healed (``/metrics``) and memory stayed flat as above (a replaced
stage is a new process: it is measured from its start).

    python benchmarks/soak.py --minutes 15 --chaos-every-s 90   # or: nox -s soak -- ...
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


CHAOS_PROMPTS = 8  # distinct greedy prompts of the chaos load: each completion must equal its reference


def chaos_prompt(i: int, input_len: int) -> list[int]:
    return [1 + (i * 31 + j * 7) % 300 for j in range(input_len)]


def streamed(client: httpx.Client, url: str, body: dict) -> str:
    """A streamed completion's text, chunk after chunk as the client sees it; raises on an error event."""
    text = ""
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"an error event mid-stream: {event['error']}")
            text += event["choices"][0]["text"]
    return text


def chaos_load(url: str, model: str, stop: threading.Event, counts: list[int], input_len: int, output_len: int,
               reference: list[str], bad: list[str], seed: int) -> None:
    """Greedy streams of the chaos prompts, round robin; a failure or a text unlike its reference is recorded."""
    with httpx.Client(timeout=300) as client:
        i = seed
        while not stop.is_set():
            k = i % CHAOS_PROMPTS
            body = {"model": model, "prompt": chaos_prompt(k, input_len), "max_tokens": output_len,
                    "ignore_eos": True, "temperature": 0}
            try:
                text = streamed(client, url, body)
                if text != reference[k] and not stop.is_set():
                    bad.append(f"prompt {k}: {len(text)} chars unlike the reference's {len(reference[k])}")
            except Exception as exc:  # noqa: BLE001 - counted, the load goes on
                if not stop.is_set():
                    bad.append(f"prompt {k}: {type(exc).__name__}: {exc}"[:300])
            counts[0] += 1
            i += 1


def chaos_monkey(server_pid: int, stop: threading.Event, every_s: float, kills: list[tuple[float, int]],
                 start: float) -> None:
    """Every ``every_s`` seconds, SIGKILL one of the server's stage actor processes (a descendant of the server
    this script started), in turn."""
    n = 0
    while not stop.wait(every_s):
        stages = sorted(pid for pid in descendants(server_pid) if role(pid, server_pid) == "stage")
        if not stages:
            continue
        victim = stages[n % len(stages)]
        n += 1
        try:
            os.kill(victim, signal.SIGKILL)
            kills.append((time.monotonic() - start, victim))
            print(f"chaos: killed stage actor pid {victim}", flush=True)
        except ProcessLookupError:
            pass


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
    p.add_argument("--chaos-every-s", type=float, default=0.0,
                   help="kill a stage actor process this often (0: never); the load is then greedy streams whose "
                        "text must equal a reference taken before, and no request may fail")
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
        stop, counts, bad, kills = threading.Event(), [0], [], []
        if args.chaos_every_s:
            with httpx.Client(timeout=300) as client:
                reference = [streamed(client, url, {"model": model, "prompt": chaos_prompt(k, args.input_len),
                                                    "max_tokens": args.output_len, "ignore_eos": True,
                                                    "temperature": 0}) for k in range(CHAOS_PROMPTS)]
            clients = [threading.Thread(target=chaos_load, args=(url, model, stop, counts, args.input_len,
                                                                  args.output_len, reference, bad, c), daemon=True)
                       for c in range(args.concurrency)]
        else:
            clients = [threading.Thread(target=load, args=(url, model, stop, counts, args.input_len, args.output_len),
                                        daemon=True) for _ in range(args.concurrency)]
        for t in clients:
            t.start()
        samples: dict[int, list[tuple[float, int]]] = {}
        roles: dict[int, str] = {}
        start, started_at = time.monotonic(), time.time()
        if args.chaos_every_s:
            threading.Thread(target=chaos_monkey, args=(server.pid, stop, args.chaos_every_s, kills, start),
                             daemon=True).start()
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
        code = report(samples, roles, args, counts[0], serve_args, stage_compiles(stages, started_at))
        if args.chaos_every_s:
            recoveries, deadline = 0.0, time.monotonic() + 120  # a kill at the very end heals after the load
            while recoveries < len(kills) and time.monotonic() < deadline:
                metrics = httpx.get(f"{url}/metrics", timeout=10).text
                recoveries = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                 if line.startswith("pipejax:engine_recoveries_total{"))
                time.sleep(0 if recoveries >= len(kills) else 2)
            print(f"chaos: {len(kills)} stage actors killed (every {args.chaos_every_s:g} s), {recoveries:.0f} "
                  f"recoveries, {counts[0]} greedy streams, {len(bad)} failed or unlike their reference")
            for line in bad[:10]:
                print(f"  {line}")
            ok = not bad and recoveries >= len(kills) > 0
            print(f"{'PASS' if ok else 'FAIL'}: no request failed or differed, every kill healed")
            code = code or (0 if ok else 1)
        return code
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
