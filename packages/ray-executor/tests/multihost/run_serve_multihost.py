"""The driver of the multi-host serving test: runs inside the head's network namespace, joins RAY_ADDRESS.

    ip netns exec pj-h0 python run_serve_multihost.py --hosts '[...]' --workdir DIR --dpl 1

1. The reference: greedy completions of PROMPTS from an in-process engine (this process).
2. ``pipejax serve -dp 2 -dpl N -dpb ray --data-parallel-address <head ip>`` started here (the API
   server on the head): each engine must report a host of the namespace cluster (``-dpl 1``: engine 0
   on the head, engine 1 elsewhere; ``-dpl 0``: neither on the head), and each engine's completions
   (pinned with ``X-data-parallel-rank``) must equal the reference.
3. With long requests in flight on both engines, engine 1's host is lost (the orchestrator cuts its
   link and kills its processes, asked through ``driver_checks.ask``): engine 1's requests must move to engine 0
   and finish (the API server sends them again with the tokens they had), engine 0's must finish,
   ``/health`` must say degraded (engine 1 waits to be rebuilt: no host has room), and new requests
   must still be served. Then the host comes back (a new Ray node on it): engine 1 is rebuilt there,
   ``/health`` is ok and its completions equal the reference. Every wait has a timeout.

The summary goes to ``summary.json`` in ``--workdir``; exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from driver_checks import (  # this folder is on sys.path: run as a script
    Checks,
    ask,
    free_port,
    request,
    stop_server,
    wait_healthy,
)

PROMPTS = ["Hello, pipejax!", "The quick brown fox", "pipelines", "hosts and ranks"]
MAX_TOKENS = 8




def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", required=True, help='JSON list of {"name", "ip", "devices"}; the first is the head')
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--dpl", type=int, default=1, help="--data-parallel-size-local of the server")
    ap.add_argument("--detect-limit-s", type=float, default=30.0)
    ap.add_argument("--lose-host", action="store_true", help="phase 3: lose engine 1's host")
    return ap.parse_args(argv)


def complete(base: str, prompt: str, rank: int, max_tokens: int = MAX_TOKENS, timeout: float = 120) -> tuple[int, dict]:
    body = {"model": "builtin", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return request(f"{base}/v1/completions", body, {"X-data-parallel-rank": str(rank)}, timeout)


def reference_texts() -> list[str]:
    from pipejax.ray_executor import LLM, SamplingParams

    llm = LLM("builtin", num_kv_blocks=64, warmup=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def main() -> int:
    args = parse_args()
    hosts = json.loads(args.hosts)
    names = {h["name"] for h in hosts}
    head = hosts[0]
    check = Checks("serve-driver")
    summary: dict = {"dpl": args.dpl, "timings": {}}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(args.workdir / "serve.log", "w")  # noqa: SIM115 (closed below)
    server = None
    try:
        t0 = time.monotonic()
        expected = reference_texts()
        summary["timings"]["reference_s"] = round(time.monotonic() - t0, 1)
        cmd = [sys.executable, "-m", "pipejax.ray_executor.cli", "serve", "--model", "builtin", "-dp", "2",
               "-dpl", str(args.dpl), "-dpb", "ray", "--data-parallel-address", head["ip"], "--host", "127.0.0.1",
               "--port", str(port), "--num-kv-blocks", "128", "--max-num-seqs", "16", "--heartbeat-timeout", "20",
               "--no-warmup"]
        t0 = time.monotonic()
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        health = wait_healthy(base, server, timeout_s=300)
        summary["timings"]["serve_ready_s"] = round(time.monotonic() - t0, 1)
        engine_hosts = [e["host"] for e in health["engines"]]
        summary["engine_hosts"] = engine_hosts
        check("every engine runs on a host of the cluster", set(engine_hosts) <= names, str(engine_hosts))
        if args.dpl == 1:
            check("-dpl 1: engine 0 on the head, engine 1 on another host",
                  engine_hosts[0] == head["name"] and engine_hosts[1] != head["name"], str(engine_hosts))
        else:
            check("-dpl 0: no engine on the head (the API server alone)", head["name"] not in engine_hosts,
                  str(engine_hosts))
        for rank in (0, 1):
            got = []
            for prompt in PROMPTS:
                status, body = complete(base, prompt, rank)
                got.append(body["choices"][0]["text"] if status == 200 else f"HTTP {status}: {body}")
            check(f"engine {rank}'s completions equal the single-host run", got == expected,
                  "" if got == expected else f"got {got}, want {expected}")
        if args.lose_host:
            lose_engine_host(base, health, hosts, args, check, summary, expected)
    except Exception as exc:  # a crash is a failed check, and still gives a summary
        traceback.print_exc()
        check("no unexpected exception", False, f"{type(exc).__name__}: {exc}")
    finally:
        summary["timings"]["server_stop_s"] = stop_server(server)
        log.close()
    summary["checks"], summary["notes"] = check.results, check.notes
    summary["ok"] = all(check.results.values())
    (args.workdir / "summary.json").write_text(json.dumps(summary, default=str))
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["ok"] else 1


def lose_engine_host(base: str, health: dict, hosts: list[dict], args, check: Checks, summary: dict,
                     expected: list[str]) -> None:
    victim = health["engines"][1]
    ip = next(h["ip"] for h in hosts if h["name"] == victim["host"])
    results: dict[int, tuple] = {}

    def long_request(i: int) -> None:
        try:
            status, body = complete(base, f"long {i}", i % 2, max_tokens=300, timeout=90)
        except Exception as exc:  # a hang past the timeout is a result too
            status, body = None, {"error": repr(exc)}
        results[i] = (status, body, time.time())

    threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    killed_at = ask(args.workdir, "lose", timeout_s=60, engine=1, ip=ip, host=victim["host"])
    if not check("the orchestrator lost the host", killed_at is not None, "no answer within 60 s"):
        return
    for t in threads:
        t.join(timeout=120)
    check("no request hangs", all(not t.is_alive() for t in threads))
    moved = {i: r for i, r in results.items() if i % 2 == 1}
    served = {i: r for i, r in results.items() if i % 2 == 0}
    summary["moved"] = {i: (r[0], r[1].get("usage") or r[1]) for i, r in moved.items()}
    check("engine 1's requests move to engine 0 and finish",
          len(moved) == 3 and all(r[0] == 200 and r[1]["usage"]["completion_tokens"] == 300 for r in moved.values()),
          str(summary["moved"]))
    summary["timings"]["moved_done_s"] = round(max((r[2] - killed_at for r in moved.values()), default=-1), 1)
    check("engine 0 keeps serving its requests",
          len(served) == 3 and all(r[0] == 200 and r[1]["usage"]["completion_tokens"] == 300 for r in served.values()),
          str({i: (r[0], r[1].get("usage")) for i, r in served.items()}))
    status, body = request(f"{base}/health", timeout=10)
    summary["health"] = body
    check("/health says degraded", status == 503 and body.get("status") == "degraded", f"{status} {body}")
    status, body = complete(base, "after the loss", 0)
    check("new requests are served", status == 200, f"{status} {body}")

    # The host comes back: the head's rebuild of engine 1 (waiting for room) lands there and it rejoins.
    t0 = time.monotonic()
    check("the orchestrator brought the host back", ask(args.workdir, "join", ip=ip) is not None)
    deadline = time.monotonic() + 180
    while (status := request(f"{base}/health", timeout=10)[0]) != 200 and time.monotonic() < deadline:
        time.sleep(1)
    summary["timings"]["join_to_healthy_s"] = round(time.monotonic() - t0, 1)
    check("engine 1 is rebuilt and /health is ok", status == 200, f"{status}")
    got = [complete(base, prompt, 1) for prompt in PROMPTS]
    texts = [body["choices"][0]["text"] if status == 200 else f"HTTP {status}: {body}" for status, body in got]
    check("the rebuilt engine 1's completions equal the single-host run", texts == expected, str(texts))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main())
