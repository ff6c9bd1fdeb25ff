"""The driver of the serving heal test: runs inside the head's network namespace, joins RAY_ADDRESS.

    ip netns exec pj-h0 python run_serve_heal.py --hosts '[...]' --workdir DIR

``pipejax serve -pp 2 -tp 2 --distributed-executor-backend ray`` (one engine, its stages Ray actors) on a head
and two workers of 2 devices: stage 0 on the head, stage 1 on a worker, the other worker spare. Driven by the
official ``openai`` client.

1. A clean run: 16 concurrent greedy streams of 64 tokens.
2. The same 16 streams; once each has a few tokens (how many: random, seeded), the host of stage 1 is lost
   (link cut, every process killed). The engine moves the stage to the spare: every stream completes with no
   error, token for token the clean run's text. The time from the loss to the next token is printed.
3. No spare left: with requests in flight the host of stage 1 is lost again. Within detection and
   ``--recovery-timeout`` they fail (HTTP 500) naming the stage and what to add; the server does not exit:
   ``/health`` says degraded (503) and a new request gets 503 naming why.
4. The first lost host comes back (a new Ray node on it): the same server process serves again, ``/health``
   is ok and the 16 streams equal the clean run.

The orchestrator is asked through files in ``--workdir`` (``driver_checks.ask``). The summary goes to
``summary.json`` there; exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import openai
from driver_checks import (  # run as a script: on sys.path
    Checks,
    ask,
    ask_for,
    free_port,
    request,
    stop_server,
    wait_healthy,
)

PROMPTS = [f"stream {i} goes on" for i in range(16)]
MAX_TOKENS = 64
STAGE = "ray::StageActor"  # the process title of a stage actor: the orchestrator finds its host by it


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", required=True, help='JSON list of {"name", "ip", "devices"}; the first is the head')
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--recovery-timeout", type=float, default=20.0)
    ap.add_argument("--detect-limit-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 1000)
    return ap.parse_args(argv)


async def streams(base: str, tokens_before_loss: int = 0, lose=None) -> tuple[list, list[float]]:
    """The 16 streams at once; each result is (text, completion tokens) or the exception it raised. With
    ``lose``, it is called once every stream has ``tokens_before_loss`` chunks; also returns every chunk's time."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    chunks, times = [0] * len(PROMPTS), []

    async def one(i: int):
        text, tokens = "", 0
        async for chunk in await client.completions.create(
                model="builtin", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                chunks[i] += 1
                times.append(time.time())
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    if lose is not None:
        while min(chunks) < tokens_before_loss and not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)
        await asyncio.to_thread(lose)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return [r if isinstance(r, tuple) else f"{type(r).__name__}: {r}" for r in results], times


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name}{{"))


def main() -> int:
    args = parse_args()
    check = Checks("serve-heal")
    summary: dict = {"seed": args.seed, "timings": {}}
    rng = random.Random(args.seed)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(args.workdir / "serve.log", "w")  # noqa: SIM115 (closed below)
    server = None
    try:
        cmd = [sys.executable, "-m", "pipejax.ray_executor.cli", "serve", "--model", "builtin", "-pp", "2", "-tp", "2",
               "--distributed-executor-backend", "ray",
               "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "256", "--max-num-seqs", "16",
               "--recovery-timeout", str(args.recovery_timeout), "--no-warmup"]
        t0 = time.monotonic()
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(base, server, timeout_s=300)
        summary["timings"]["serve_ready_s"] = round(time.monotonic() - t0, 1)

        # 1. The clean run.
        t0 = time.monotonic()
        clean, _ = asyncio.run(streams(base))
        summary["timings"]["clean_s"] = round(time.monotonic() - t0, 1)
        check("the clean run completes", all(isinstance(r, tuple) and r[1] == MAX_TOKENS for r in clean), str(clean))

        # 2. Stage 1's host lost mid-stream: healed onto the spare.
        lost: dict = {}

        def lose():
            lost.update(ask_for(args.workdir, "lose", running=STAGE) or {})

        before = rng.randint(2, 24)
        summary["tokens_before_loss"] = before
        healed, times = asyncio.run(streams(base, before, lose))
        if not check("the orchestrator lost the host of stage 1", bool(lost)):
            return 1
        summary["first_lost"] = lost["host"]
        # Tokens already on their way arrive just after the loss; the stall is the longest gap between tokens
        # after it, and the loss's cost the time from the loss to the token that ends the stall.
        after = sorted(t for t in times if t > lost["time"])
        gaps = [(b - a, b) for a, b in zip([lost["time"], *after[:-1]], after, strict=True)]
        stall, resumed = max(gaps, default=(None, None))
        summary["timings"]["stall_s"] = round(stall, 2) if stall else None
        summary["timings"]["loss_to_next_token_s"] = round(resumed - lost["time"], 2) if resumed else None
        summary["timings"]["recovery_s"] = round(metric(base, "pipejax:recovery_seconds_total"), 2)
        errors = [r for r in healed if not isinstance(r, tuple)]
        check("no stream sees an error", not errors, str(errors[:3]))
        check("every stream equals the clean run, token for token", healed == clean,
              f"{sum(h == c for h, c in zip(healed, clean, strict=True))}/{len(clean)} equal")
        check("one recovery", metric(base, "pipejax:engine_recoveries_total") == 1)
        check("the next token came within 30 s of the loss", resumed is not None and resumed - lost["time"] < 30,
              str(summary["timings"]))

        # 3. No spare: requests fail by name, the server stays up and says why.
        no_spare(base, args, check, summary, server)

        # 4. The first lost host joins again: the same server serves as before.
        t0 = time.monotonic()
        joined = ask(args.workdir, "join", ip=lost["ip"])
        check("the orchestrator brought the host back", joined is not None)
        health = wait_healthy(base, server, timeout_s=args.recovery_timeout + 120)
        summary["timings"]["join_to_healthy_s"] = round(time.monotonic() - t0, 1)
        check("/health is ok again", health["status"] == "ok", str(health))
        again, _ = asyncio.run(streams(base))
        check("after the host joined, the streams equal the clean run", again == clean,
              f"{sum(a == c for a, c in zip(again, clean, strict=True))}/{len(clean)} equal")
        check("the same server process served throughout", server.poll() is None)
        check("two recoveries (the spare, then the host that joined)",
              metric(base, "pipejax:engine_recoveries_total") == 2)
    except Exception as exc:  # a crash is a failed check, and still gives a summary
        traceback.print_exc()
        check("no unexpected exception", False, f"{type(exc).__name__}: {exc}")
    finally:
        stop_server(server)
        log.close()
    summary["checks"], summary["notes"] = check.results, check.notes
    summary["ok"] = all(check.results.values())
    (args.workdir / "summary.json").write_text(json.dumps(summary, default=str))
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["ok"] else 1


def no_spare(base: str, args, check: Checks, summary: dict, server: subprocess.Popen) -> None:
    results: dict[int, tuple] = {}
    body = {"model": "builtin", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    def long_request(i: int) -> None:
        try:
            results[i] = (*request(f"{base}/v1/completions", {**body, "prompt": f"long {i}"}, timeout=150),
                          time.time())
        except Exception as exc:  # a hang past the timeout is a result too
            results[i] = (None, {"error": repr(exc)}, time.time())

    threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    lost = ask_for(args.workdir, "lose", running=STAGE)
    if not check("the orchestrator lost the second host", lost is not None):
        return
    for t in threads:
        t.join(timeout=args.detect_limit_s + args.recovery_timeout + 60)
    check("no request hangs", all(not t.is_alive() for t in threads))
    failed_s = max((r[2] - lost["time"] for r in results.values()), default=-1)
    summary["timings"]["no_spare_failed_s"] = round(failed_s, 1)
    messages = [str(r[1].get("error", {}).get("message", r[1])) for r in results.values()]
    check("every request failed with HTTP 500 naming the stage and what to add",
          len(results) == 4 and all(r[0] == 500 for r in results.values())
          and all("no node could take stage 1" in m and "add a node" in m for m in messages), str(messages[:2]))
    check(f"they failed within detection + the recovery timeout + slack ({args.detect_limit_s:.0f} s)",
          0 <= failed_s < args.detect_limit_s + args.recovery_timeout, f"{failed_s:.1f}s")
    deadline = time.monotonic() + 5  # the engine's heartbeat (every 0.1 s) reaches the API server
    while (status := request(f"{base}/health", timeout=10))[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, health = status
    summary["health_without_spare"] = health
    check("/health says degraded (503), the engine waiting for a node",
          status == 503 and health.get("status") == "degraded" and "waits for a node" in health.get("error", ""),
          f"{status} {health}")
    status, refused = request(f"{base}/v1/completions", {**body, "prompt": "meanwhile", "max_tokens": 4}, timeout=30)
    check("a new request gets 503 naming why", status == 503 and "waits for a node" in json.dumps(refused),
          f"{status} {refused}")
    check("the server does not exit", server.poll() is None, f"exit status {server.poll()}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main())
