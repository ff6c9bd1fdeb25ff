"""The pipeline's schedule, apart from the work: simulated stages on namespace hosts.

A 2-core machine cannot show a pipeline's schedule with real stages (the driver, Ray and every stage share
the cores), so here each stage's step takes a set time without using a core (``EngineConfig.simulated_step_s``:
the stage runs its real step of a tiny model, ``builtin:deep``, then sleeps out the rest, as a step on a
device of its own is waited for). Everything else is real: the engine, the Ray executor, one Ray node per
stage in its own network namespace with its own IP (``tests/multihost/netns_cluster.py``), and the
activations on the JAX transfer server from stage to stage.

Per pp, one cluster of pp hosts; on it the plain Ray executor, then the compiled graph, each a fresh engine in
the driver's process (on host 0). Each engine runs the same workload with 1, pp and pp + 1 batches in flight
(each batch of ``--requests-per-stage`` requests), alternating. Reported per run:

- output tok/s, and against the ideal: pp x the same engine's one-batch-in-flight rate (the goal: >= 0.9x);
- the bubble: 1 - (each stage's busy time, from its inputs in hand to its output sent) / (pp x wall);
- the driver's time per step: the engine's wall time outside its waits on the stages, per batch submitted;
- per step at 1 in flight, the overhead: the step's time past pp x the stage time, and its hand-offs (driver ->
  stage 0, stage -> stage, last stage -> driver, the driver's turnaround);
- the cores busy: the driver's process, the stages' processes, the whole machine.

    python benchmarks/pipeline_schedule.py                  # pp 2 4 8, 20 ms stages
    python benchmarks/pipeline_schedule.py --pp 2 --repeats 1 --json /tmp/schedule.json

Needs root (network namespaces), like the ``multihost`` nox session.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
MULTIHOST = HERE.parent / "packages" / "ray-executor" / "tests" / "multihost"  # its netns cluster helper
PREFIX = "pjsch"
MODES = ("plain", "compiled", "compiled-shm")  # compiled: zmq edges (the default); -shm: Ray's spinning channel


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stage-ms", type=float, default=20.0, help="each stage's simulated step")
    ap.add_argument("--requests-per-stage", type=int, default=4,
                    help="requests per batch: a run holds this x its batches in flight")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs (1 in flight, pp in flight) per engine")
    ap.add_argument("--modes", nargs="+", default=["plain", "compiled"], choices=MODES,
                    help="executors to run: plain Ray, the compiled graph (zmq edges), and with 'compiled-shm' the "
                         "compiled graph on Ray's shared-memory channel (default: plain compiled)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the part that runs on host 0
    return ap.parse_args(argv)


# --- the driver: on host 0, inside the cluster ----------------------------------------------------------


def run_workload(engine, depth: int, args, tag: str) -> dict:
    """One run of ``requests-per-stage x depth`` greedy requests with at most ``depth`` batches in flight (the
    engine splits the active requests into ``depth`` batches: every run's batches hold ``requests-per-stage``)."""
    from pipejax.runner.batch import SamplingParams

    pp = engine.config.parallel.pipeline_parallel_size
    executor = engine.executor
    executor.config = dataclasses.replace(executor.config, max_batches_in_flight=depth)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    n = args.requests_per_stage * depth  # each batch in flight holds requests_per_stage requests
    for i in range(n):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(args.prompt_len)]},
                           params)
    waited = 0.0
    submitted: dict[int, float] = {}  # step id -> when the driver handed it to the executor
    returned: dict[int, float] = {}  # step id -> when its output was in the driver's hands
    original_wait, original_execute = engine._wait, executor.execute_model

    def timed_wait(batch, future):
        nonlocal waited
        t = time.perf_counter()
        try:
            return original_wait(batch, future)
        finally:
            returned[batch.step_id] = time.perf_counter()
            waited += returned[batch.step_id] - t

    def timed_execute(batch):
        submitted[batch.step_id] = time.perf_counter()
        return original_execute(batch)

    engine._wait, executor.execute_model = timed_wait, timed_execute
    trace_before = len(executor.step_trace())
    processes = [psutil.Process(os.getpid())] + [psutil.Process(info.pid) for info in executor.stage_infos()]
    cpu_before, machine_before = [sum(p.cpu_times()[:2]) for p in processes], psutil.cpu_times()
    start = time.perf_counter()
    tokens = 0
    try:
        while engine.has_unfinished_requests():
            tokens += sum(len(out.outputs[0].token_ids) for out in engine.step_finished())
    finally:
        del engine._wait, executor.execute_model
    wall = time.perf_counter() - start
    cpu = [sum(p.cpu_times()[:2]) - before for p, before in zip(processes, cpu_before, strict=True)]
    machine = psutil.cpu_times()
    idle = (machine.idle + machine.iowait) - (machine_before.idle + machine_before.iowait)
    trace = executor.step_trace()[trace_before:]
    steps = len({sid for _, sid, _, _ in trace})
    busy = sum(end - begin for _, _, begin, end in trace)
    return {
        "gaps_ms": gaps(trace, submitted, returned, pp),
        "cores_driver": cpu[0] / wall,
        "cores_stages": sum(cpu[1:]) / wall,
        "stage_cpu_ms_per_step": sum(cpu[1:]) / max(1, len(trace)) * 1e3,  # a stage's CPU time for one step
        "cores_machine": psutil.cpu_count() - idle / wall,
        "depth": depth,
        "requests": n,
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "batches": steps,
        "bubble": 1 - busy / (pp * wall),
        "driver_ms_per_step": (wall - waited) / steps * 1e3,
        "step_ms": wall / steps * 1e3,  # per batch; at depth 1 the whole pipeline's turn
        "stage_ms_median": statistics.median((end - begin) * 1e3 for _, _, begin, end in trace),
    }


def gaps(trace, submitted: dict[int, float], returned: dict[int, float], pp: int) -> dict[str, float]:
    """Median milliseconds of each hand-off of a step, from the driver's and the stages' clocks (one machine: the
    same monotonic clock): driver -> stage 0's start ("dispatch"), stage r's end -> stage r+1's start ("hop"),
    the last stage's end -> the output in the driver ("return"), and the output -> the driver's next submit
    ("turnaround")."""
    by_step: dict[int, dict[int, tuple[float, float]]] = {}
    for rank, sid, begin, end in trace:
        by_step.setdefault(sid, {})[rank] = (begin, end)
    out: dict[str, list[float]] = {"dispatch": [], "hop": [], "return": [], "turnaround": []}
    submits = sorted(submitted.values())
    for sid, stages in by_step.items():
        if len(stages) < pp or sid not in submitted or sid not in returned:
            continue
        out["dispatch"].append(stages[0][0] - submitted[sid])
        out["hop"] += [stages[r + 1][0] - stages[r][1] for r in range(pp - 1)]
        out["return"].append(returned[sid] - stages[pp - 1][1])
        later = [t for t in submits if t > returned[sid]]
        if later:
            out["turnaround"].append(later[0] - returned[sid])
    return {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in out.items()}


def driver(args) -> None:
    pp = args.pp[0]
    os.environ.update(JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    from pipejax.ray_executor.engine.engine import LLMEngine
    from pipejax.ray_executor.engine_args import engine_config

    results = []
    for mode in args.modes:
        config = engine_config(
            "builtin:deep", pipeline_parallel_size=pp, distributed_executor_backend="ray",
            ray_address=os.environ["RAY_ADDRESS"], ray_compiled_graph=mode != "plain", num_kv_blocks=512,
            ray_graph_channel="shared_memory" if mode == "compiled-shm" else None,
            max_model_len=128, step_trace_len=1 << 16, cpu_kernel_build="cached", recovery="off",
        )
        engine = LLMEngine(dataclasses.replace(config, simulated_step_s=args.stage_ms / 1e3))
        try:
            engine.executor.warmup(progress=False)
            run_workload(engine, pp, args, f"{mode}-warm")  # the run's shapes (and the compiled graph) once
            for r in range(args.repeats):
                depths = (1, pp, pp + 1)  # pp + 1: one batch more than stages hides each batch's turnaround
                for depth in depths if r % 2 == 0 else depths[::-1]:
                    out = run_workload(engine, depth, args, f"{mode}-{r}-{depth}")
                    results.append({"pp": pp, "mode": mode, **out})
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        finally:
            engine.shutdown()
    print(json.dumps(results), flush=True)


# --- the orchestrator: the cluster, then the report ------------------------------------------------------


def one_pp(pp: int, args) -> list[dict]:
    sys.path.insert(0, str(MULTIHOST))
    from netns_cluster import HostSpec, NetnsCluster

    hosts = [HostSpec(f"10.213.0.{20 + i}", 1) for i in range(pp)]
    with NetnsCluster(hosts, prefix=PREFIX, object_store_bytes=80 << 20) as cluster:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--driver", "--pp", str(pp),
               "--stage-ms", str(args.stage_ms), "--requests-per-stage", str(args.requests_per_stage),
               "--output-len", str(args.output_len), "--prompt-len", str(args.prompt_len),
               "--repeats", str(args.repeats), "--modes", *args.modes]
        proc = cluster.popen(0, cmd, env={"RAY_ADDRESS": cluster.address}, stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"the pp={pp} driver failed ({proc.returncode})")
        return json.loads(out.strip().splitlines()[-1])


def summarize(results: list[dict], args) -> list[dict]:
    rows = []
    for pp in sorted({r["pp"] for r in results}):
        for mode in MODES:
            runs = [r for r in results if r["pp"] == pp and r["mode"] == mode]
            if not runs:
                continue
            one = [r for r in runs if r["depth"] == 1]
            full = [r for r in runs if r["depth"] == pp]
            extra = [r for r in runs if r["depth"] == pp + 1]
            med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
            rows.append({
                "pp": pp, "mode": mode,
                "tok_s_1": med(one, "tok_s"), "tok_s_pp": med(full, "tok_s"),
                "vs_ideal": med(full, "tok_s") / (pp * med(one, "tok_s")),
                "bubble_pp": med(full, "bubble"),
                "vs_stage_bound": med(full, "tok_s") / (args.requests_per_stage / (args.stage_ms / 1e3)),
                "tok_s_pp1": med(extra, "tok_s"),
                "pp1_vs_stage_bound": med(extra, "tok_s") / (args.requests_per_stage / (args.stage_ms / 1e3)),
                "driver_ms_per_step": med(full, "driver_ms_per_step"),
                **{f"{k}_ms_1": statistics.median(r["gaps_ms"][k] for r in one) for k in one[0]["gaps_ms"]},
                "overhead_ms_per_step_1": med(one, "step_ms") - pp * args.stage_ms,
                "stage_ms": med(full, "stage_ms_median"),
                "cores_machine_pp": med(full, "cores_machine"), "cores_stages_pp": med(full, "cores_stages"),
                "cores_driver_pp": med(full, "cores_driver"),
                "stage_cpu_ms_per_step": med(full, "stage_cpu_ms_per_step"),
            })
    return rows


def print_table(rows: list[dict], args) -> None:
    print(f"\nsimulated {args.stage_ms:g} ms stages, {args.requests_per_stage} requests per stage, "
          f"{args.prompt_len} in -> {args.output_len} out, median of {args.repeats} run(s) each")
    print("| pp | executor | tok/s, 1 in flight | tok/s, pp in flight | vs ideal: pp x 1 in flight (goal >= 0.9) "
          "| vs stages' bound | bubble, pp in flight | driver ms/step | stage ms | stage CPU ms/step "
          f"| cores busy: driver, stages, machine (of {psutil.cpu_count()}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp']} | {r['mode']} | {r['tok_s_1']:.1f} | {r['tok_s_pp']:.1f} | {r['vs_ideal']:.2f}x | "
              f"{r['vs_stage_bound']:.2f}x | {r['bubble_pp']:.1%} | {r['driver_ms_per_step']:.2f} | "
              f"{r['stage_ms']:.1f} | {r['stage_cpu_ms_per_step']:.2f} | {r['cores_driver_pp']:.2f}, "
              f"{r['cores_stages_pp']:.2f}, {r['cores_machine_pp']:.2f} |")
    print("\npp + 1 batches in flight (each of the same size): tok/s, and against the stages' bound")
    print("| pp | executor | tok/s | vs stages' bound |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp']} | {r['mode']} | {r['tok_s_pp1']:.1f} | {r['pp1_vs_stage_bound']:.2f}x |")
    print("\nOne batch in flight, a step's hand-offs (median ms): overhead = the step past pp x the stage time")
    print("| pp | executor | overhead | driver -> stage 0 | stage -> next stage | last stage -> driver "
          "| driver's turnaround |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp']} | {r['mode']} | {r['overhead_ms_per_step_1']:.2f} | {r['dispatch_ms_1']:.2f} | "
              f"{r['hop_ms_1']:.2f} | {r['return_ms_1']:.2f} | {r['turnaround_ms_1']:.2f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.driver:
        return driver(args)
    results = []
    for pp in args.pp:
        t = time.monotonic()
        results += one_pp(pp, args)
        print(f"pp={pp}: {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
    rows = summarize(results, args)
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                         "summary": rows}, indent=1))


if __name__ == "__main__":
    main()
