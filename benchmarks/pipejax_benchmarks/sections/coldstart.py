"""Cold start of ``pipejax generate`` to its first token, broken down.

Each repeat is a fresh process doing what ``pipejax generate`` does with the Ray backend and the
command's default layout (pp=2 x tp=2 on simulated CPU devices, default KV sizing) on the
benchmark model: import, start a local Ray cluster, build the engine (placement group, stage
actors, each stage's JAX start, weights and KV cache), compile the warm-up buckets, then one prompt
to its first token. Each stage's ``StageWorker`` notes when its set-up phases ran (read with
``collective_rpc("setup_timings")``), which splits the engine build; every phase is wall-clock
time from the process's creation.

Each repeat is two starts on a persistent compilation cache of its own: the first with the cache
empty (a first-ever start), the second with what the first left in it (every later start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from pipejax.worker.worker import CACHE_DIR_ENV
from pipejax_benchmarks.sections.common import section_main, summary

PHASES = (
    "python + imports",
    "Ray start (local cluster)",
    "placement group + stage actors (processes, imports, transfer server)",
    "stage init (StageWorker: devices, mesh, model config)",
    "load (weights + KV cache)",
    "compile (warm-up buckets)",
    "first token (one prompt: prefill + sample)",
)


def process_start_time() -> float:
    """When this process was created (epoch seconds), from /proc (Linux)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: start time, clock ticks after boot
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def child() -> None:
    """One cold start; prints a JSON line of phase -> seconds."""
    born = process_start_time()
    from pipejax.ray_executor.cli import build_parser
    from pipejax.ray_executor.engine_args import configure_devices, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "builtin:bench", "--distributed-executor-backend", "ray",
                                      "--max-tokens", "1", "--cpu-kernel-build", "cached",  # generate's default
                                      "Hello, pipejax!"])
    configure_devices(args)
    import ray

    from pipejax.ray_executor import LLM
    from pipejax.runner.batch import SamplingParams

    config = engine_config_from_args(args)  # the checkpoint exists already (generated before the timed process)
    t_imports = time.time()
    need = args.pipeline_parallel_size * args.tensor_parallel_size
    # as the engine's connect() does, but always a new local cluster (another may run on this machine)
    ray.init(address="local", resources={config.ray.device_resource: need}, include_dashboard=False,
             log_to_driver=False)
    t_ray = time.time()
    llm = LLM.from_config(config, warmup=False)
    llm.engine.executor.warmup()
    t_compiled = time.time()
    marks = llm.engine.executor.collective_rpc("setup_timings")  # each stage's wall-clock set-up phases
    out = llm.generate(args.prompts, SamplingParams(temperature=0, max_tokens=1))
    t_first = time.time()
    assert len(out[0].outputs[0].token_ids) == 1
    init_start = min(m["init"][0] for m in marks)
    init_end = max(m["init"][1] for m in marks)
    compile_start = min(m["warmup"][0] for m in marks)
    phases = dict(zip(PHASES, (
        t_imports - born,
        t_ray - t_imports,
        init_start - t_ray,
        init_end - init_start,
        compile_start - init_end,  # with the transport connect, KV sizing and the engine's own set-up (small)
        t_compiled - compile_start,
        t_first - t_compiled,
    ), strict=True))
    kv_blocks = llm.engine.executor.num_kv_blocks
    llm.shutdown()
    print(json.dumps({"phases": phases, "total": t_first - born, "kv_blocks": kv_blocks}), flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipejax_benchmarks.sections.common import bench_model

    bench_model()  # generate the checkpoint outside the timed processes
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    runs: dict[str, list[dict]] = {"empty": [], "warm": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="pipejax-coldstart-cache-") as cache:
            env[CACHE_DIR_ENV] = cache
            for kind in ("empty", "warm"):
                proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child"], capture_output=True,
                                      text=True, env=env, timeout=900)
                if proc.returncode != 0:
                    raise RuntimeError(f"cold-start process failed: {proc.stderr[-3000:]}")
                runs[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {"layout": "pp=2 tp=2, Ray backend, benchmark model",
                           "kv_blocks": runs["empty"][0]["kv_blocks"]}
    for kind, key in (("empty", ""), ("warm", "warm_cache_")):
        out[f"{key}phases"] = {p: summary([r["phases"][p] for r in runs[kind]]) for p in PHASES}
        out[f"{key}total"] = summary([r["total"] for r in runs[kind]])
    out["warm_vs_first"] = summary([w["total"] / e["total"] for w, e in zip(runs["warm"], runs["empty"], strict=True)])
    return out


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        section_main(run, __doc__)
