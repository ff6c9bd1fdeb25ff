"""Engine step time of the Ray executor next to the in-process one, and of Ray Compiled Graph mode
next to plain Ray calls: pp=1 tp=1, decode at batch 32.

Three engines on the benchmark model share one local Ray cluster: in-process (the stage in this
process), Ray (the stage in a Ray actor, one actor call per step) and Ray Compiled Graph (its own
actor chained in a compiled graph). Each run: 32 requests x 16 prompt tokens x 32 output tokens;
a step is one ``LLMEngine.step()`` (schedule, execute, wait, update) and only steps whose batch is
32 decode rows count; each run gives its median step, a figure is the median over runs with
min-max. Phase 1 alternates in-process and Ray runs; phase 2 builds the compiled graph and
alternates it with Ray runs (which then run beside the idle graph: reported separately). The
compiled graph is compared with phase 1's Ray runs, run i with run i. The stage's own step time
(its trace) splits a step into stage work and what the executor adds; each process's CPU seconds
per wall second (driver, every stage actor) show who competes with the stage for the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import time
from typing import Any

from pipejax_benchmarks.sections.common import (
    bench_model,
    cpu_seconds,
    engine_kwargs,
    process_cpu_seconds,
    prompts,
    section_main,
    self_profile,
    stage_pids,
    summary,
)
from pipejax_benchmarks.sections.throughput import BatchRecorder

BATCH, INPUT, OUTPUT = 32, 16, 32
MODES = {
    "in-process": {"distributed_executor_backend": "uni"},
    "ray": {"distributed_executor_backend": "ray"},
    "ray compiled graph": {"distributed_executor_backend": "ray", "ray_compiled_graph": True},
}
GOAL_RAY, GOAL_CG = 1.10, 1.0
PROFILE_RATE = 500  # samples/s: the Python threads are active only a few % of a step
_ids = itertools.count()


def decode_steps(llm, recorder: BatchRecorder, batch_prompts, output_len: int) -> list[tuple[int, float]]:
    """(step id, seconds) of every engine step whose batch was all decode rows of the full batch."""
    from pipejax.runner.batch import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    for p in batch_prompts:
        engine.add_request(f"x{next(_ids)}", {"prompt_token_ids": p}, params)
    out = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        sid = max(recorder.batches)
        b = recorder.batches[sid]
        if not b["prefill"] and b["rows"] == len(batch_prompts):
            out.append((sid, elapsed))
    return out


def stage_ms(llm, step_ids: set[int]) -> float | None:
    """Median of the stage's own time for ``step_ids`` (None where the trace is out of reach)."""
    if llm.engine.config.ray.compiled_graph:  # actors inside a compiled graph take no other calls
        return None
    return summary([(e - s) * 1e3 for _, sid, s, e in llm.engine.executor.step_trace() if sid in step_ids])["median"]


class _Sleeper:
    def step(self, x):
        time.sleep(0.2)  # a stage busy for 200 ms without using a core
        return x


def cg_wait_probe(steps: int = 10) -> dict[str, float]:
    """Driver cores busy while a compiled graph's only actor sleeps 200 ms per step, with pipejax's
    ``read_iteration_timeout`` (its step timeout) and with Ray's default: what waiting for the graph
    costs the driver when the stage uses no CPU."""
    import ray
    from ray.dag import DAGContext, InputNode

    out = {}
    ctx = DAGContext.get_current()
    saved = (ctx.get_timeout, ctx.submit_timeout, ctx.read_iteration_timeout)
    try:
        for label, iteration_timeout in (("pipejax's read_iteration_timeout (300 s)", 300.0),
                                         ("Ray's default read_iteration_timeout (0.1 s)", 0.1)):
            actor = ray.remote(num_cpus=0)(_Sleeper).remote()
            ctx.get_timeout, ctx.submit_timeout, ctx.read_iteration_timeout = 300, 300, iteration_timeout
            with InputNode() as inp:
                graph = actor.step.bind(inp).experimental_compile()
            graph.execute(0).get()
            cpu, start = cpu_seconds(), time.perf_counter()
            for i in range(steps):
                graph.execute(i).get()
            out[label] = (cpu_seconds() - cpu) / (time.perf_counter() - start)
            graph.teardown(kill_actors=True)
    finally:
        ctx.get_timeout, ctx.submit_timeout, ctx.read_iteration_timeout = saved
    return out


class Measured:
    """Runs of each engine: median step per run, the stage's own step, and cores busy per process."""

    def __init__(self, llms, recorders, batch_prompts, output: int):
        self.llms, self.recorders, self.prompts, self.output = llms, recorders, batch_prompts, output
        self.wall: dict[str, list[float]] = {}
        self.stage: dict[str, list[float]] = {}
        self.cores: dict[str, dict[str, list[float]]] = {}

    def pids(self) -> dict[str, int]:
        out = {"driver": os.getpid()}
        for name, llm in self.llms.items():
            if name != "in-process":
                out[f"{name} actor"] = stage_pids(llm)[0]
        return out

    def run(self, name: str, label: str | None = None) -> None:
        label = label or name
        pids = self.pids()
        before = {k: process_cpu_seconds(p) for k, p in pids.items()}
        start = time.perf_counter()
        steps = decode_steps(self.llms[name], self.recorders[name], self.prompts, self.output)
        wall = time.perf_counter() - start
        cores = self.cores.setdefault(label, {})
        for k, p in pids.items():
            cores.setdefault(k, []).append((process_cpu_seconds(p) - before[k]) / wall)
        self.wall.setdefault(label, []).append(summary([t * 1e3 for _, t in steps])["median"])
        ms = stage_ms(self.llms[name], {sid for sid, _ in steps})
        if ms is not None:
            self.stage.setdefault(label, []).append(ms)

    def profile(self, name: str, profile_dir: str) -> dict[str, Any]:
        """py-spy the driver and the stage actor during one more run of ``name``."""
        tag = name.replace(" ", "-")
        actor = stage_pids(self.llms[name])[0]
        with contextlib.ExitStack() as stack:
            profs = {f"{name}: driver": stack.enter_context(
                         self_profile(f"{profile_dir}/executors-{tag}-driver.pyspy.txt", rate=PROFILE_RATE)),
                     f"{name}: stage actor": stack.enter_context(
                         self_profile(f"{profile_dir}/executors-{tag}-actor.pyspy.txt", rate=PROFILE_RATE, pid=actor))}
            decode_steps(self.llms[name], self.recorders[name], self.prompts, self.output)
        return {k: p.summary() for k, p in profs.items() if p.ok}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from pipejax.ray_executor.executor.ray_placement import CPU_DEVICE_RESOURCE
    from pipejax.ray_executor.llm import LLM

    resource = os.environ.get("PIPEJAX_RAY_DEVICE_RESOURCE", CPU_DEVICE_RESOURCE)
    start = time.perf_counter()
    # address="local": a new cluster of our own, even if another one runs on this machine
    ray.init(address="local", resources={resource: len(MODES)}, include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - start
    output = 16 if args.quick else OUTPUT
    path = bench_model()
    llms, recorders = {}, {}

    def build(name: str) -> None:
        kw = MODES[name]
        llms[name] = LLM(path, warmup=False, **engine_kwargs(max_num_seqs=BATCH, max_num_batched_tokens=512), **kw)
        recorders[name] = BatchRecorder(llms[name])
        decode_steps(llms[name], recorders[name], batch_prompts, output)  # compile (and build the graph)

    batch_prompts = prompts(BATCH, INPUT, 32000)
    m = Measured(llms, recorders, batch_prompts, output)
    result: dict[str, Any] = {"workload": {"batch": BATCH, "input_len": INPUT, "output_len": output},
                              "ray_start_s": ray_start_s, "profile": {}}
    # Phase 1: in-process and plain Ray, alternating. (No compiled graph exists yet: its actors poll
    # their input channel while idle, which would take CPU from the others.)
    build("in-process")
    build("ray")
    for r in range(args.repeats):
        for name in ("in-process", "ray") if r % 2 == 0 else ("ray", "in-process"):
            m.run(name)
    result["ratio_ray"] = summary([a / b for a, b in zip(m.wall["ray"], m.wall["in-process"], strict=True)])
    if args.profile_dir and result["ratio_ray"]["median"] > GOAL_RAY:
        result["profile"].update(m.profile("ray", args.profile_dir))
    # Phase 2: the compiled graph, alternating with plain Ray runs beside it (what an idle graph costs others).
    build("ray compiled graph")
    beside = "ray beside an idle compiled graph"
    for r in range(args.repeats):
        for name in ("ray compiled graph", "ray") if r % 2 == 0 else ("ray", "ray compiled graph"):
            m.run(name, beside if name == "ray" else None)
    result["ratio_cg"] = summary([a / b for a, b in zip(m.wall["ray compiled graph"], m.wall["ray"], strict=True)])
    if args.profile_dir and result["ratio_cg"]["median"] > GOAL_CG:
        result["profile"].update(m.profile("ray compiled graph", args.profile_dir))
    result.update(
        step_ms={k: summary(v) for k, v in m.wall.items()},
        stage_ms={k: summary(v) for k, v in m.stage.items()},
        cores={k: {p: summary(v) for p, v in per.items()} for k, per in m.cores.items()},
    )
    for llm in llms.values():
        llm.shutdown()
    result["cg_wait_probe"] = cg_wait_probe()
    ray.shutdown()
    return result


if __name__ == "__main__":
    section_main(run, __doc__)
