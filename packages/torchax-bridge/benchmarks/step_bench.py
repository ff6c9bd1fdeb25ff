"""Decode-step time of the torchax path vs the native JAX path, on the built-in benchmark model.

    .venv/bin/python packages/torchax-bridge/benchmarks/step_bench.py [--batches 1,16,64] [--context 128] [--json PATH]

Both paths run as a ``StageRunner`` (pp=1, tp=1, one CPU device) of ``ensure_builtin_model("bench")``
(Llama, 124.7M parameters, float32) with the same paged KV cache and sampler; only the model
implementation differs. One decode step: ``batch`` requests, one new token each at position
``context``, i.e. ``StageRunner.execute`` (greedy sampling included) until the sampled tokens are
on the host. The two runners alternate step by step, so both see the same machine load. Each cell
is the median over ``--iters`` steps after a warm-up (compilation); the ratio is torchax / native.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from pipejax.pp_utils import stage_mesh  # noqa: E402
from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest  # noqa: E402
from pipejax.runner.builtin_model import cache_dir_from_env, ensure_builtin_model  # noqa: E402
from pipejax.runner.config import CacheConfig, SchedulerConfig, StageConfig  # noqa: E402
from pipejax.runner.runner import StageRunner  # noqa: E402

IMPLS = ("jax", "torchax")
BLOCK_SIZE = 16
WARMUP = 3


def decode_batch(batch: int, context: int, step: int) -> ModelBatch:
    """``batch`` requests decoding their token at position ``context`` (block 0 stays reserved)."""
    blocks = math.ceil((context + 1) / BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0)
    requests = tuple(
        ScheduledRequest(f"r{i}", (7 + i,), context, tuple(range(1 + i * blocks, 1 + (i + 1) * blocks)), greedy)
        for i in range(batch)
    )
    return ModelBatch(step, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="tokens already in each request's KV cache")
    parser.add_argument("--iters", type=int, default=30, help="timed steps per batch size and implementation")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    path = ensure_builtin_model("bench", cache_dir_from_env(os.environ))
    blocks = math.ceil((args.context + 1) / BLOCK_SIZE)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + max(batches) * blocks)
    limits = SchedulerConfig(
        max_model_len=args.context + 1, max_num_seqs=max(batches), max_num_batched_tokens=max(batches)
    )
    mesh = stage_mesh(jax.devices()[:1])
    runners = {}
    for impl in IMPLS:
        start = time.perf_counter()
        runners[impl] = StageRunner(path, mesh, StageConfig(), cache, model_impl=impl, scheduler=limits)
        print(f"{impl}: loaded in {time.perf_counter() - start:.1f} s")

    rows = []
    for batch in batches:
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        compile_s = {}
        for impl, runner in runners.items():
            start = time.perf_counter()
            runner.execute(decode_batch(batch, args.context, 0))
            compile_s[impl] = time.perf_counter() - start
            for step in range(1, WARMUP):
                runner.execute(decode_batch(batch, args.context, step))
        for step in range(args.iters):
            for impl, runner in runners.items():
                b = decode_batch(batch, args.context, WARMUP + step)
                start = time.perf_counter()
                runner.execute(b)  # returns host token ids: the step is complete
                times[impl].append(time.perf_counter() - start)
        native, torchax = (statistics.median(times[impl]) * 1e3 for impl in IMPLS)
        rows.append((batch, native, torchax, torchax / native, compile_s["jax"], compile_s["torchax"]))

    print(f"\nbench model, decode at context {args.context}, median of {args.iters} steps, {jax.devices()[0].platform}")
    print(
        "| decode batch | native step (ms) | torchax step (ms) | ratio torchax/native "
        "| first step native / torchax (s) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for batch, native, torchax, ratio, c_native, c_torchax in rows:
        print(f"| {batch} | {native:.2f} | {torchax:.2f} | {ratio:.2f} | {c_native:.1f} / {c_torchax:.1f} |")
    if args.json:
        figures = {"context": args.context, "iters": args.iters, "platform": jax.devices()[0].platform, "decode": {
            str(batch): {"native_ms": native, "torchax_ms": torchax, "ratio": ratio,
                         "first_step_s": {"native": c_native, "torchax": c_torchax}}
            for batch, native, torchax, ratio, c_native, c_torchax in rows}}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
