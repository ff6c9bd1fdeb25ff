"""pp=2 throughput with two batches in flight (the batch queue) next to the same engine with one.

The headline workload (64 requests x 128 in x 64 out) on two pp=2 tp=1 engines, one after the other:

- ``own cores`` (the headline): the Ray executor with ``pin_stage_cpus``, so each stage actor runs
  on its own half of the machine's cores, as each stage would own its chips;
- ``shared cores``: the in-process executor, two stage threads whose XLA computations share all the
  cores: pipelining can then only fill the gaps the host-side work leaves.

Between runs an engine's batch queue is capped at 2 or 1 (``max_batches_in_flight``), so both
settings share compiled code and alternate under the same load (at most two pairs of runs per
engine, for time). Next to each run: the cores the engine's processes kept busy (CPU seconds / wall
seconds) and how busy the whole machine was.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from pipejax_benchmarks.sections.common import (
    INPUT_LEN,
    NUM_PROMPTS,
    OUTPUT_LEN,
    CpuMeter,
    bench_model,
    compiled_shapes,
    engine_kwargs,
    process_cpu_seconds,
    prompts,
    section_main,
    self_profile,
    stage_pids,
    summary,
)
from pipejax_benchmarks.sections.throughput import pipejax_run

GOAL = 1.6
MAX_REPEATS = 2  # pairs of headline runs (each ~30-60 s here): the report's time budget


def set_depth(llm, depth: int) -> None:
    """Cap the batch queue (the executor reads ``config.max_batches_in_flight`` at every step)."""
    executor = llm.engine.executor
    executor.config = dataclasses.replace(executor.config, max_batches_in_flight=depth)
    assert executor.max_concurrent_batches == depth


def engine_pids(llm) -> list[int]:
    """The driver, and the stage actors' processes when the engine runs on Ray."""
    return sorted({os.getpid(), *stage_pids(llm)})


def measure(llm, all_prompts, repeats: int) -> dict[str, Any]:
    start = time.perf_counter()
    for depth in (2, 1):  # compile the shapes each setting meets: the whole workload once (with fewer output
        set_depth(llm, depth)  # tokens, requests finish among others' prefills and the steps mix differently)
        pipejax_run(llm, all_prompts)
    warm_s = time.perf_counter() - start
    compiled_before = compiled_shapes(llm)
    tps: dict[int, list[float]] = {2: [], 1: []}
    cores: dict[int, list[float]] = {2: [], 1: []}
    machine: dict[int, list[float]] = {2: [], 1: []}
    pids = engine_pids(llm)
    for r in range(min(repeats, MAX_REPEATS)):
        for depth in (2, 1) if r % 2 == 0 else (1, 2):
            set_depth(llm, depth)
            meter = CpuMeter().start()
            cpu = sum(process_cpu_seconds(p) for p in pids)
            t = pipejax_run(llm, all_prompts)
            used = meter.stop()
            cores[depth].append((sum(process_cpu_seconds(p) for p in pids) - cpu) / t)
            machine[depth].append(used["machine_busy"])
            tps[depth].append(NUM_PROMPTS * OUTPUT_LEN / t)
    out = {
        "tps": {d: summary(v) for d, v in tps.items()},
        "ratio": summary([a / b for a, b in zip(tps[2], tps[1], strict=True)]),
        "cores_busy": {d: summary(v) for d, v in cores.items()},
        "machine_busy": {d: summary(v) for d, v in machine.items()},
        "warm_runs_s": warm_s,
    }
    out["shapes_compiled_during_timed_runs"] = compiled_shapes(llm) - compiled_before
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipejax.ray_executor.llm import LLM

    variants = {
        "own cores": dict(distributed_executor_backend="ray", pin_stage_cpus=True),
        "shared cores": dict(distributed_executor_backend="uni"),
    }
    result: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "variants": {}}
    for name, kwargs in variants.items():
        llm = LLM(bench_model(), pipeline_parallel_size=2, warmup=False, **kwargs, **engine_kwargs())
        all_prompts = prompts(NUM_PROMPTS, INPUT_LEN, llm.engine.model_config.vocab_size)
        v = measure(llm, all_prompts, args.repeats)
        if name == "shared cores" and args.profile_dir and v["ratio"]["median"] < GOAL:
            set_depth(llm, 2)
            with self_profile(f"{args.profile_dir}/pipeline.pyspy.txt") as prof:
                pipejax_run(llm, all_prompts)
            v["profile"] = prof.summary()
        llm.shutdown()
        result["variants"][name] = v
    result.update({k: result["variants"]["own cores"][k] for k in ("tps", "ratio", "cores_busy", "machine_busy")})
    if "profile" in result["variants"]["shared cores"]:
        result["profile"] = result["variants"]["shared cores"].pop("profile")
    return result


if __name__ == "__main__":
    section_main(run, __doc__)
