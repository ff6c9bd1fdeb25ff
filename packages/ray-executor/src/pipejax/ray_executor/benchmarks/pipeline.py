"""pp=2 throughput with two batches in flight (the batch queue) next to the same engine with one.

One pp=2 tp=1 in-process engine (two stage threads on two simulated CPU devices) runs the headline
workload (64 requests x 128 in x 64 out); between runs its batch queue is capped at 2 or 1
(``max_batches_in_flight``), so both settings share the compiled code and alternate under the same
machine load (at most two pairs of runs, for time). Next to each run: the CPU cores the process
kept busy (CPU seconds / wall seconds) and how busy the whole machine was, which say whether
overlapping the stages could still add compute. (The stages' step trace cannot say how busy each
stage was: JAX dispatches asynchronously, so stage 0's step returns before its computation ends
and stage 1's step includes waiting for it.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from pipejax.ray_executor.benchmarks.common import (
    INPUT_LEN,
    NUM_PROMPTS,
    OUTPUT_LEN,
    CpuMeter,
    bench_model,
    engine_kwargs,
    prompts,
    section_main,
    self_profile,
    summary,
)
from pipejax.ray_executor.benchmarks.throughput import pipejax_run

GOAL = 1.6
MAX_REPEATS = 2  # pairs of headline runs (each ~30-60 s here): the report's time budget
WARMUP_OUTPUT_LEN = 8


def set_depth(llm, depth: int) -> None:
    """Cap the batch queue (the executor reads ``config.max_batches_in_flight`` at every step)."""
    executor = llm.engine.executor
    executor.config = dataclasses.replace(executor.config, max_batches_in_flight=depth)
    assert executor.max_concurrent_batches == depth


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipejax.ray_executor.llm import LLM

    llm = LLM(bench_model(), pipeline_parallel_size=2, distributed_executor_backend="uni", warmup=False,
              **engine_kwargs())
    all_prompts = prompts(NUM_PROMPTS, INPUT_LEN, llm.engine.model_config.vocab_size)
    start = time.perf_counter()
    for depth in (2, 1):  # compile the shapes each setting meets (2 in flight: two batches of 32 rows); 8 output
        set_depth(llm, depth)  # tokens meet the same shapes as 64 (the context stays in one block bucket)
        pipejax_run(llm, all_prompts, WARMUP_OUTPUT_LEN)
    warm_s = time.perf_counter() - start
    tps: dict[int, list[float]] = {2: [], 1: []}
    cores: dict[int, list[float]] = {2: [], 1: []}
    machine: dict[int, list[float]] = {2: [], 1: []}
    compiled_before = [len(w.runner.compiled_shapes) for w in llm.engine.executor.workers]
    for r in range(min(args.repeats, MAX_REPEATS)):
        for depth in (2, 1) if r % 2 == 0 else (1, 2):
            set_depth(llm, depth)
            meter = CpuMeter().start()
            t = pipejax_run(llm, all_prompts)
            used = meter.stop()
            cores[depth].append(used["cores"])
            machine[depth].append(used["machine_busy"])
            tps[depth].append(NUM_PROMPTS * OUTPUT_LEN / t)
    compiled_after = [len(w.runner.compiled_shapes) for w in llm.engine.executor.workers]
    result: dict[str, Any] = {
        "tps": {d: summary(v) for d, v in tps.items()},
        "ratio": summary([a / b for a, b in zip(tps[2], tps[1], strict=True)]),
        "cores_busy": {d: summary(v) for d, v in cores.items()},
        "machine_busy": {d: summary(v) for d, v in machine.items()},
        "cpus": os.cpu_count(),
        "warm_runs_s": warm_s,
        "shapes_compiled_during_timed_runs": sum(compiled_after) - sum(compiled_before),
    }
    if args.profile_dir and result["ratio"]["median"] < GOAL:
        set_depth(llm, 2)
        with self_profile(f"{args.profile_dir}/pipeline.pyspy.txt") as prof:
            pipejax_run(llm, all_prompts)
        result["profile"] = prof.summary()
    llm.shutdown()
    return result


if __name__ == "__main__":
    section_main(run, __doc__)
