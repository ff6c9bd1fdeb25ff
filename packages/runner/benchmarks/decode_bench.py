"""Decode-step time of the runner on the benchmark model (or ``--model PATH``, any checkpoint the runner serves),
next to this machine's floor.

floor = max(FLOPs / measured matmul rate, weight bytes / measured resident read bandwidth)

On a host whose rates drift (a shared VM), ``--rounds N`` measures the floor and the steps again N times, each
round's floor next to its own steps, and sums up each batch's step / floor as the median [min-max] of the rounds.

Also the peak RSS of loading one stage of a pp=2 split against loading the whole model, each in
a fresh process. Run: python packages/runner/benchmarks/decode_bench.py [--batches 1 16 64] [--model PATH]
(a Mixture-of-Experts checkpoint's floor counts every expert: the runner's dense formulation of its experts).
``DecodeSteps`` is the same step held in a process for others to time on request (``moe_step.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from decode_floor import DecodeBench  # noqa: E402  (this folder's; run as a script)
from machine_floor import CONTEXT, machine_rates, step_cost, timed  # noqa: E402


class DecodeSteps:
    """``decode_floor.DecodeBench``'s decode step of the checkpoint at ``path`` (128 tokens cached per request,
    sampling included), built and compiled at each of ``batches`` once, then timed on request: in a process of
    its own (``bench_support.EngineProcess``), two models' steps can be timed alternately."""

    def __init__(self, path: str, batches: list[int], decode_attention: str = "auto", decode_layers: str = "auto",
                 few_row_dots: str = "auto", dense_matmuls: str = "auto", quantization: str | None = None):
        self.bench = DecodeBench(path, batches, decode_attention, decode_layers, dense_matmuls,
                                 few_row_dots=few_row_dots, quantization=quantization)
        self.first_step_s = self.bench.compile_steps(batches)

    def seconds(self, batch: int, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` steps of ``batch`` requests (after one untimed)."""
        return timed(lambda: self.bench.step(batch), repeats)

    def first_steps(self) -> dict[int, float]:
        """Seconds of each batch's first step, its compile included."""
        return self.first_step_s

    def switches(self) -> dict[str, str]:
        r = self.bench.runner
        return {"decode_attention": r.decode_attention, "decode_layers": r.decode_layers,
                "dense_matmuls": r.dense_matmuls, "few_row_dots": r.few_row_dots}


def decode_steps(path: str, batches: list[int], decode_attention: str, decode_layers: str, few_row_dots: str,
                 dense_matmuls: str, quantization: str | None) -> DecodeSteps:
    """``DecodeSteps`` built and compiled, its switches and first steps printed."""
    steps = DecodeSteps(path, batches, decode_attention, decode_layers, few_row_dots, dense_matmuls, quantization)
    print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in steps.switches().items()))
    for b, seconds in steps.first_step_s.items():
        print(f"batch {b}: first step (its compile included) {seconds:.2f} s")
    return steps


def step_times(steps: DecodeSteps, batches: list[int], repeats: int) -> dict[int, tuple[float, float, float]]:
    """(median, min, max) seconds of ``repeats`` steps at each batch."""
    out = {}
    for b in batches:
        times = steps.seconds(b, repeats)
        out[b] = (statistics.median(times), min(times), max(times))
    return out


def held_weight_bytes(steps: DecodeSteps) -> int:
    params, tied = steps.bench.runner.params, steps.bench.cfg.tie_word_embeddings
    return sum(w.nbytes for name, w in params.items() if tied or name != "embed")


# The probe's own peak RSS is VmHWM of /proc/self/status (the high-water mark of its address space,
# which starts afresh at exec). Not getrusage's ru_maxrss: Linux carries that over exec from the
# process that spawned the probe, so after this script's own big arrays both readings were the
# parent's peak and every growth came out as 0.
RSS_PROBE = """
import os, sys, json
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from pipejax.pp_utils import stage_mesh
from pipejax.runner.checkpoint import load_stage_params
from pipejax.runner.config import ModelConfig, StageConfig

def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

path, pp_rank, pp_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = ModelConfig.from_pretrained(path, quantization=sys.argv[4] or None)
mesh = stage_mesh(jax.devices()[:1])
jax.device_put(jax.numpy.zeros(1)).block_until_ready()
base = peak_rss()
params = load_stage_params(path, cfg, StageConfig(pp_rank, pp_size), mesh)
jax.block_until_ready(params)
peak = peak_rss()
print(json.dumps({"base": base, "peak": peak, "param_bytes": sum(p.nbytes for p in params.values())}))
"""


def load_rss(path: str, pp_rank: int, pp_size: int, quantization: str | None = None) -> dict:
    """Peak RSS of loading one stage's weights (pp_rank of pp_size) in a fresh process on one CPU device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, path, str(pp_rank), str(pp_size), quantization or ""],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--decode-attention", choices=("auto", "xla", "cpu-kernel"), default="auto",
                        help="XLA's decode attention or the CPU kernel (auto: the kernel on CPU)")
    parser.add_argument("--decode-layers", choices=("auto", "scan", "unrolled"), default="auto",
                        help="a scan over stacked weights, or unrolled layers over per-layer views "
                        "(auto: unrolled on CPU)")
    parser.add_argument("--few-row-dots", choices=("auto", "ynnpack", "eigen"), default="auto",
                        help="the library of the dots of 4-32-row decode steps (auto: measured at the first such step)")
    parser.add_argument("--dense-matmuls", choices=("auto", "xla", "cpu-kernel"), default="auto",
                        help="XLA's dot over [in, out] weights, or the CPU dense kernel over weights in panels "
                        "(auto: the kernel on CPU in float32)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the floor and the steps again this many times, each round's floor against its "
                        "own steps (hosts whose rates drift)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS probes")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the built-in bench model)")
    parser.add_argument("--quantization", choices=("gguf", "int8", "int4"), default=None,
                        help="weights kept quantized (the floor then counts the bytes the stage holds)")
    args = parser.parse_args()

    from pipejax.runner.builtin_model import cache_dir_from_env, ensure_builtin_model
    from pipejax.runner.config import ModelConfig

    path = args.model or str(ensure_builtin_model("bench", cache_dir_from_env(os.environ)))
    cfg = ModelConfig.from_pretrained(path, quantization=args.quantization)
    steps = decode_steps(path, args.batches, args.decode_attention, args.decode_layers, args.few_row_dots,
                         args.dense_matmuls, args.quantization)
    held_bytes = held_weight_bytes(steps)
    results = {"weight_bytes_read": held_bytes, "rounds": []}
    name = args.model or "benchmark model"
    held = f"weights {args.quantization}" if args.quantization else "fp32"
    for round_ in range(args.rounds):
        rates = machine_rates(references=False)
        flops_rate, bandwidth = rates["flops"], rates["bandwidth"]
        print(
            f"\n{f'round {round_ + 1}: ' if args.rounds > 1 else ''}machine: matmul {flops_rate / 1e9:.1f} GFLOP/s "
            f"(2048^3 fp32), memory {bandwidth / 1e9:.2f} GB/s read (a reduction over a resident 1 GiB array), "
            f"{os.cpu_count()} CPUs"
        )
        figures = {"matmul_gflops": flops_rate / 1e9, "memory_gbps": bandwidth / 1e9, "decode": {}}
        print(f"decode step, {name} ({held}, pp1 tp1, context {CONTEXT}), median of {args.repeats} [min-max]")
        print("| batch | step ms | floor ms | step / floor | bound by |")
        print("|---:|---:|---:|---:|---|")
        for b, (med, lo, hi) in step_times(steps, args.batches, args.repeats).items():
            flops, weight_bytes = step_cost(cfg, b)
            if args.quantization:  # the bytes held (packed)
                weight_bytes = held_bytes
            compute, memory = flops / flops_rate, weight_bytes / bandwidth
            floor = max(compute, memory)
            bound = "compute" if compute >= memory else "memory"
            print(f"| {b} | {med * 1e3:.1f} [{lo * 1e3:.1f}-{hi * 1e3:.1f}] | {floor * 1e3:.1f} | {med / floor:.2f}x "
                  f"| {bound} |")
            figures["decode"][b] = {"ms": med * 1e3, "min": lo * 1e3, "max": hi * 1e3, "floor_ms": floor * 1e3}
        results["rounds"].append(figures)
    results.update(results["rounds"][0])  # the first round's figures where one round's are read
    if args.rounds > 1:
        print(f"\nstep / floor over {args.rounds} rounds, median [min-max]:")
        for b in args.batches:
            ratios = [r["decode"][b]["ms"] / r["decode"][b]["floor_ms"] for r in results["rounds"]]
            print(f"  batch {b}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    if not args.no_rss:
        whole = load_rss(path, 0, 1, args.quantization)
        stages = [load_rss(path, r, 2, args.quantization) for r in range(2)]
        print("\npeak RSS while loading (fresh process each; growth over the process after importing JAX)")
        print("| what | RSS growth MB | parameters MB |")
        print("|---|---:|---:|")
        for name, r in [("whole model (pp=1)", whole), ("stage 0 of pp=2", stages[0]), ("stage 1 of pp=2", stages[1])]:
            print(f"| {name} | {(r['peak'] - r['base']) / 2**20:.0f} | {r['param_bytes'] / 2**20:.0f} |")
        results["rss"] = {"whole": whole, "stages": stages}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
