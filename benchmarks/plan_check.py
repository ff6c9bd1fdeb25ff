"""`pipejax plan`'s predictions held against the engine on this host: each layout's decode-step time per stage and
its output tok/s, predicted from FLOPs and bytes (``modelled``) and from the model's parts measured here (``--measure``:
``plan.MeasuredParts``; ``from_parts``), beside the engine's own (``engine``). Predicted throughput is a wave's (the
prompts prefilled, then the outputs decoded); the engine's also pays the driver's turnaround.

The parent measures this host (``plan.measure_cpu_host``) and, with ``--measure``, the model's parts, before any
engine runs. Then each layout runs in a fresh process, in the order given, ``--rounds`` times alternating:
``LLM(model, pp, tp)`` on the split the plan predicts, its stages' step traces on, ``--num-prompts`` greedy requests
of ``--input-len`` tokens in and ``--output-len`` out, twice (the first run compiles). The decode steps are the second
half of the timed run's traced steps; a stage's figure is the median of its own time in them: with the Ray
executor (``--backend ray``, the default) a stage's traced step runs from its inputs in hand to its output sent, in
the stage's own process, slowed by whatever shares its cores, as served. With in-process stages (``--backend uni``)
a stage returns before its device work ends (JAX dispatches asynchronously), so only the sum over the stages
compares (also printed). Output tok/s is the timed run's. Each layout runs with the KV blocks the plan gives it,
and with ``--measure`` the peak RSS (VmHWM) of every process holding its stages (each stage's Ray actor, or the
layout's process) is printed beside the plan's prediction of it.

    python benchmarks/plan_check.py --model builtin:bench --layouts 1x1 2x1 --measure
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("PIPEJAX_CPU_KERNEL_BUILD", "wait")  # one formulation throughout the timed runs
DEVICES = 8


def one_layout(model: str, pp: int, tp: int, split: str, backend: str, prompts: int, input_len: int,
               output_len: int, kv_blocks: int) -> dict:
    from pipejax.ray_executor import LLM, SamplingParams
    from pipejax.worker.memory_probe import peak_rss

    llm = LLM(None if model == "default" else model, pipeline_parallel_size=pp, tensor_parallel_size=tp,
              distributed_executor_backend=backend, max_num_seqs=prompts, max_model_len=input_len + output_len,
              step_trace_len=1 << 16, pp_layer_partition=split if pp > 1 else None, num_kv_blocks=kv_blocks)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(input_len)]} for i in range(prompts)]
    llm.generate(batch, params)  # compiles
    engine = llm.engine
    start = len(engine.executor.step_trace())
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    wall = time.perf_counter() - t0
    trace = engine.executor.step_trace()[start:]
    by_step: dict[int, dict[int, tuple[float, float]]] = {}
    for rank, step, a, b in trace:
        by_step.setdefault(step, {})[rank] = (a, b)
    steps = sorted(s for s, ranks in by_step.items() if len(ranks) == pp)
    decode = steps[len(steps) // 2:]
    own = [[] for _ in range(pp)]
    for s in decode:
        ranks = by_step[s]
        for r in range(pp):
            a, b = ranks[r]
            # in-process stages: a later stage's step starts before the previous one's work is done
            own[r].append(b - max(a, ranks[r - 1][1]) if r and backend == "uni" else b - a)
    # the processes holding the stages: each stage's Ray actor, or this one
    pids = [p["pid"] for p in engine.executor.placement] if backend == "ray" else [os.getpid()]
    peaks = [peak_rss(pid) / 2**20 for pid in pids]
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"stage_ms": [statistics.median(t) * 1e3 for t in own], "steps": len(decode), "tok_s": tokens / wall,
            "peak_rss_mib": peaks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:bench")
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x1"], help="pp x tp, e.g. 2x2")
    ap.add_argument("--backend", choices=["ray", "uni"], default="ray")
    ap.add_argument("--measure", action="store_true", help="also predict from the model's parts measured here")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every layout, alternating")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--split", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-blocks", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pp, tp = map(int, args.child.split("x"))
        print("RESULT " + json.dumps(one_layout(args.model, pp, tp, args.split, args.backend, args.num_prompts,
                                                 args.input_len, args.output_len, args.kv_blocks)))
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
    import dataclasses

    from pipejax.platform_tpu.hardware import Hardware
    from pipejax.ray_executor import plan
    from pipejax.ray_executor.engine_args import resolve_model
    from pipejax.runner.config import ModelConfig

    path = resolve_model(None if args.model == "default" else args.model)
    model = ModelConfig.from_pretrained(path)
    work = plan.Workload(max_model_len=args.input_len + args.output_len, concurrency=args.num_prompts,
                         prompt_len=args.input_len, output_len=args.output_len)
    modelled = plan.measure_cpu_host()
    print(f"host: {modelled.source}")
    ways = {"modelled": modelled}  # predicted from FLOPs and bytes; "from_parts": from the parts measured here
    if args.measure:
        started = time.perf_counter()
        parts = plan.MeasuredParts(path, model, work.concurrency, work.prompt_len + work.output_len // 2,
                                   prompt_len=work.prompt_len, max_model_len=work.max_model_len)
        ways["from_parts"] = dataclasses.replace(modelled, parts=parts)
        for tp in sorted({int(lay.split("x")[1]) for lay in args.layouts}):
            parts(tp)
            parts.memory(tp)
        print(f"parts measured in {time.perf_counter() - started:.1f} s at rows {parts.rows}")
    hw = Hardware("cpu", chips_per_host=DEVICES)
    predicted = {}
    for layout in args.layouts:
        pp, tp = map(int, layout.split("x"))
        predicted[layout] = {way: plan.predict(model, hw, dev, work, pp, tp, backend=args.backend)
                             for way, dev in ways.items()}
    split_by = "from_parts" if args.measure else "modelled"
    runs: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
    for _ in range(args.rounds):
        for layout in args.layouts:
            split = ",".join(map(str, predicted[layout][split_by].partition))
            kv_blocks = predicted[layout][split_by].kv_blocks
            proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--backend", args.backend,
                                   "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                                   "--output-len", str(args.output_len), "--child", layout, "--split", split,
                                   "--kv-blocks", str(kv_blocks)],
                                  capture_output=True, text=True,
                                  env={**os.environ, "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled",
                                       "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"})
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not found:
                print(f"{layout}: failed\n{proc.stderr[-3000:]}")
                return 1
            runs[layout].append(json.loads(found[-1].removeprefix("RESULT ")))
    rows = []
    for layout in args.layouts:
        pp = int(layout.split("x")[0])
        got = [statistics.median(run["stage_ms"][r] for run in runs[layout]) for r in range(pp)]
        tok_s = statistics.median(run["tok_s"] for run in runs[layout])
        split = predicted[layout][split_by].partition
        for r, g in [*enumerate(got), ("sum", sum(got))]:
            row = {"layout": layout, "stage": r, "split": split, "engine_ms": g}
            for way, pred in predicted[layout].items():
                want = (sum(pred.stage_time_s) if r == "sum" else pred.stage_time_s[r]) * 1e3
                row[f"{way}_ms"], row[f"{way}_ratio"] = want, g / want
            rows.append(row)
            print(f"{layout} stage {r} (split {','.join(map(str, split))}): engine {g:.1f} ms; " + "; ".join(
                f"{way} {row[f'{way}_ms']:.1f} ms (engine/{way} {row[f'{way}_ratio']:.2f})" for way in ways))
        tput = {"layout": layout, "stage": "tok/s", "engine_tok_s": tok_s, "split": split}
        for way, pred in predicted[layout].items():
            tput[f"{way}_tok_s"] = pred.throughput
        rows.append(tput)
        print(f"{layout}: engine {tok_s:.1f} output tok/s; predicted " + "; ".join(
            f"{way} {pred.throughput:.1f}" for way, pred in predicted[layout].items()))
        want = predicted[layout][split_by].process_memory_bytes
        if want:  # measured: each process holding stages, its peak RSS against the prediction
            peaks = [statistics.median(run["peak_rss_mib"][i] for run in runs[layout]) for i in range(len(want))]
            rows.append({"layout": layout, "stage": "memory", "split": split, "peak_rss_mib": peaks,
                         "predicted_mib": [w / 2**20 for w in want],
                         "ratio": [p / (w / 2**20) for p, w in zip(peaks, want, strict=True)]})
            print(f"{layout}: peak RSS of each process holding stages " + ", ".join(
                f"{p:.0f} MiB (predicted {w / 2**20:.0f}, {p / (w / 2**20):.2f}x)"
                for p, w in zip(peaks, want, strict=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": modelled.source, "backend": args.backend, "rows": rows, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
