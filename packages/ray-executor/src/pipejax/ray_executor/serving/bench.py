"""``pipejax bench serve``: an online benchmark against a running server, in the established format.

Random-token prompts of ``--input-len`` go to ``--endpoint`` streaming, at ``--request-rate``
(Poisson arrivals; inf = all at once), each generating exactly ``--output-len`` tokens
(``ignore_eos``). Per request: TTFT (first chunk), ITL (gaps between chunks), TPOT
((latency - TTFT) / (tokens - 1)), end-to-end latency; output tokens come from the stream's usage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time

import aiohttp


@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


def _payload(args: argparse.Namespace, model: str, prompt: list[int]) -> dict:
    common = {"model": model, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0,
              "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "/v1/chat/completions":
        text = "".join(chr(ord("a") + t % 26) for t in prompt)
        return {**common, "messages": [{"role": "user", "content": text}]}
    return {**common, "prompt": prompt}


async def _request(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "the stream carried no usage / no tokens"
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _served_model(session: aiohttp.ClientSession, base: str, headers: dict) -> str:
    async with session.get(f"{base}/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _run(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(0, 256) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _served_model(session, base, headers)
        url = base + args.endpoint
        warm = await _request(session, url, {**_payload(args, model, prompts[0]), "max_tokens": 2}, headers)
        if not warm.ok:
            raise RuntimeError(f"the test request failed: {warm.error}")
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def limited(prompt):
            async with limit:
                return await _request(session, url, _payload(args, model, prompt), headers)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _summary(args, model, results, duration)


def _stats(values: list[float], name: str) -> dict:
    ms = sorted(v * 1000 for v in values) or [0.0]
    p99 = ms[min(len(ms) - 1, max(0, round(0.99 * len(ms)) - 1))]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p99_{name}_ms": p99}


def _summary(args, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": model, "endpoint": args.endpoint, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_stats([r.ttft for r in ok], "ttft"), **_stats(tpot, "tpot"),
        **_stats([x for r in ok for x in r.itl], "itl"), **_stats([r.latency for r in ok], "e2el"),
    }
    return summary


def print_summary(s: dict) -> None:
    rows = [
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Request rate configured (RPS):", s["request_rate"]), ("Benchmark duration (s):", s["duration_s"]),
        ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", s["request_throughput"]),
        ("Output token throughput (tok/s):", s["output_throughput"]),
        ("Total Token throughput (tok/s):", s["total_token_throughput"]),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for name, value in rows:
        print(f"{name:<40}{value:<10.2f}" if isinstance(value, float) else f"{name:<40}{value:<10}")
    for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el")):
        print(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            print(f"{label:<40}{s[f'{stat}_{key}_ms']:<10.2f}")
    print("=" * 50)
    for err in s["errors"]:
        print(f"error: {err}")


def run_bench_serve(args: argparse.Namespace) -> int:
    summary = asyncio.run(_run(args))
    print_summary(summary)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
