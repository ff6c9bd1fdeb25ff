"""`pipejax plan`'s predicted decode-step time per stage, held against the engine's measured one on this host.

Each layout runs in a fresh process: ``LLM(model, pp, tp)`` (in-process stages, ``--num-prompts`` greedy requests of
``--input-len`` tokens in and ``--output-len`` out, ``step_trace_len`` on), twice (the first run compiles); a
stage's own time in a step is from the later of its start and the previous stage's end to its end (a stage after
the first waits for its activations inside its step). The decode steps are the second half of the traced steps of
the timed run; their median per stage is set beside ``plan.predict`` for the same layout and workload, with this
host measured (``plan.measure_cpu_host``) in the parent process, before any engine runs. In-process stages
return before their device work ends (JAX dispatches asynchronously), so for pp > 1 a stage's time lands in the
next stage's wait: only the sum over the stages is comparable there (also printed).

    python benchmarks/plan_check.py --model builtin:bench --layouts 1x1 2x1 2x2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("PIPEJAX_CPU_KERNEL_BUILD", "wait")  # one formulation throughout the timed runs


def one_layout(model: str, pp: int, tp: int, prompts: int, input_len: int, output_len: int) -> dict:
    from pipejax.ray_executor import LLM, SamplingParams

    llm = LLM(None if model == "default" else model, pipeline_parallel_size=pp, tensor_parallel_size=tp,
              distributed_executor_backend="uni", max_num_seqs=prompts, max_model_len=input_len + output_len,
              max_num_batched_tokens=2048, step_trace_len=1 << 16)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(input_len)]} for i in range(prompts)]
    llm.generate(batch, params)  # compiles
    engine = llm.engine
    start = len(engine.executor.step_trace())
    llm.generate(batch, params)
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
            own[r].append(b - max(a, ranks[r - 1][1]) if r else b - a)
    llm.shutdown()
    return {"stage_ms": [statistics.median(t) * 1e3 for t in own], "steps": len(decode)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:bench")
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x1"], help="pp x tp, e.g. 2x2")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pp, tp = map(int, args.child.split("x"))
        print("RESULT " + json.dumps(one_layout(args.model, pp, tp, args.num_prompts, args.input_len,
                                                 args.output_len)))
        return 0
    from pipejax.platform_tpu.hardware import Hardware
    from pipejax.ray_executor import plan
    from pipejax.ray_executor.engine_args import resolve_model
    from pipejax.runner.config import ModelConfig

    device = plan.measure_cpu_host()
    model = ModelConfig.from_pretrained(resolve_model(None if args.model == "default" else args.model))
    work = plan.Workload(max_model_len=args.input_len + args.output_len, concurrency=args.num_prompts,
                         prompt_len=args.input_len, output_len=args.output_len)
    print(f"host: {device.source}")
    rows = []
    for layout in args.layouts:
        pp, tp = map(int, layout.split("x"))
        predicted = plan.predict(model, Hardware("cpu", chips_per_host=max(8, pp * tp)), device, work, pp, tp)
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--num-prompts", str(args.num_prompts),
                               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                               "--child", layout], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu",
                                   "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not found:
            print(f"{layout}: failed\n{proc.stderr[-3000:]}")
            return 1
        measured = json.loads(found[-1].removeprefix("RESULT "))
        for r in range(pp):
            want, got = predicted.stage_time_s[r] * 1e3, measured["stage_ms"][r]
            rows.append({"layout": layout, "stage": r, "predicted_ms": want, "measured_ms": got,
                         "ratio": got / want, "split": predicted.partition})
            print(f"{layout} stage {r} (layers {predicted.partition[r]}): predicted {want:.1f} ms, measured "
                  f"{got:.1f} ms over {measured['steps']} decode steps: measured/predicted {got / want:.2f}")
        want, got = sum(predicted.stage_time_s) * 1e3, sum(measured["stage_ms"])
        rows.append({"layout": layout, "stage": "sum", "predicted_ms": want, "measured_ms": got, "ratio": got / want,
                     "split": predicted.partition})
        print(f"{layout} all stages: predicted {want:.1f} ms, measured {got:.1f} ms: measured/predicted "
              f"{got / want:.2f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
