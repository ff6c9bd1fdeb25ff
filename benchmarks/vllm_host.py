"""Benchmark: the headline workload through vLLM's engine on pipejax's stages, next to pipejax's own
engine, each in fresh processes, alternating; then vLLM's own ``vllm bench throughput`` on it.

    nox -s vllm -- bench            (or: python vllm_host.py [--repeats 2] in the vLLM venv)

Workload: 64 prompts x 128 random token ids -> 64 new tokens each (ignore_eos), temperature 1, the
124.7M-parameter fp32 benchmark model, pp=1 tp=1, the same engine limits on both sides
(64 sequences, 512 tokens per step, blocks of 16, max_model_len 256). Each run warms up with the
whole workload once (so no step compiles inside the timed run), then times a second pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 64
LIMITS = {"max_model_len": 256, "max_num_seqs": 64, "max_num_batched_tokens": 512}


def bench_model() -> str:
    from pipejax.runner.builtin_model import cache_dir_from_env, ensure_builtin_model

    return str(ensure_builtin_model("bench", cache_dir_from_env(os.environ)))


def workload(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(INPUT_LEN)] for _ in range(NUM_PROMPTS)]


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its live descendants (vLLM's engine core)."""
    import psutil

    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    return own, sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True))


def timed(generate) -> tuple[float, tuple[float, float], object]:
    """Wall seconds, (own, descendants') CPU seconds and the result of one timed pass."""
    cpu0, start = cpu_seconds(), time.perf_counter()
    out = generate()
    elapsed, cpu1 = time.perf_counter() - start, cpu_seconds()
    return elapsed, (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]), out


def time_pipejax(model: str, prompts) -> tuple[float, tuple[float, float]]:
    from pipejax.ray_executor import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", **LIMITS)
    params = SamplingParams(temperature=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    try:
        llm.generate(prompts, params)  # warm: every shape of this workload compiles here
        elapsed, cpu, out = timed(lambda: llm.generate(prompts, params))
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in out)
    return elapsed, cpu


def time_vllm(model: str, prompts) -> tuple[float, tuple[float, float]]:
    import vllm

    llm = vllm.LLM(model=model, dtype="float32", enable_prefix_caching=False, **LIMITS)
    params = vllm.SamplingParams(temperature=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    try:
        llm.generate(inputs, params, use_tqdm=False)
        elapsed, cpu, out = timed(lambda: llm.generate(inputs, params, use_tqdm=False))
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in out)
    return elapsed, cpu


def one_run(engine: str) -> None:
    model = bench_model()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    elapsed, cpu = (time_pipejax if engine == "pipejax" else time_vllm)(model, workload(vocab))
    print("RESULT " + json.dumps({"engine": engine, "seconds": elapsed, "cpu": cpu}), flush=True)


# vLLM's LLM runs its engine core in a child process by default; "vllm-inproc" runs it in the caller
# (VLLM_ENABLE_V1_MULTIPROCESSING=0), which separates that process split's cost from the worker's.
VARIANTS = {"pipejax": ("pipejax", {}), "vllm": ("vllm", {}),
            "vllm-inproc": ("vllm", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})}


def in_fresh_process(variant: str) -> dict:
    engine, extra = VARIANTS[variant]
    env = {**os.environ, "PIPEJAX_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           **extra}
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, __file__, "--one", engine], capture_output=True, text=True, env=env,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{variant} run failed:\n{proc.stderr[-4000:]}")
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "load": load}


def vllm_bench_throughput(model: str) -> str:
    """vLLM's own benchmark command on the same model and workload shape."""
    vllm_cli = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm_cli), "bench", "throughput", "--model", model, "--dtype", "float32", "--dataset-name", "random",
           "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(NUM_PROMPTS), "--max-model-len", "256", "--max-num-seqs", "64",
           "--max-num-batched-tokens", "512",
           "--no-enable-prefix-caching"]
    env = {**os.environ, "PIPEJAX_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.findall(r"^Throughput:.*$", proc.stdout + proc.stderr, re.M)
    if proc.returncode or not found:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return f"`{' '.join(['vllm', *cmd[1:]])}`: {found[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="fresh-process runs per engine, alternating")
    parser.add_argument("--one", choices=("pipejax", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--skip-vllm-bench", action="store_true")
    args = parser.parse_args()
    if args.one:
        return one_run(args.one)
    model = bench_model()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            runs[variant].append(in_fresh_process(variant))
    tokens = NUM_PROMPTS * OUTPUT_LEN
    print(f"workload: {NUM_PROMPTS} prompts x {INPUT_LEN} in -> {OUTPUT_LEN} out, fp32, temperature 1, pp1 tp1")
    print("variant      output tok/s (median; runs)        CPU s per 1k output tokens: own + child processes"
          "   load avg at start")
    rate, cpu = {}, {}
    for variant, rs in runs.items():
        rate[variant] = tokens / statistics.median(r["seconds"] for r in rs)
        own, child = (statistics.median(r["cpu"][i] * 1000 / tokens for r in rs) for i in (0, 1))
        cpu[variant] = own + child
        print(f"{variant:12s} {rate[variant]:7.1f} {[round(tokens / r['seconds'], 1) for r in rs]!s:26s}"
              f" {own:6.2f} + {child:5.2f}   {[round(r['load'], 1) for r in rs]}")
    print(f"vLLM + pipejax / pipejax's engine: {rate['vllm'] / rate['pipejax']:.2f}x output tok/s (goal >= 0.9x); "
          f"CPU per token {cpu['vllm'] / cpu['pipejax']:.2f}x; engine core in-process: "
          f"{rate['vllm-inproc'] / rate['pipejax']:.2f}x tok/s, CPU {cpu['vllm-inproc'] / cpu['pipejax']:.2f}x")
    if not args.skip_vllm_bench:
        print(vllm_bench_throughput(model))


if __name__ == "__main__":
    main()
