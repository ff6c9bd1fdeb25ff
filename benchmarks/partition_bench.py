"""``--pp-layer-partition auto`` against the even split: output tok/s at pp=2 with batches in flight.

The default model (SmolLM2-135M-Instruct: 30 layers and a tied 576 x 49152 LM head on the last stage) on the Ray
executor with ``pin_stage_cpus`` (each stage on its own share of the cores, as on chips of its own), 2 batches in
flight, 64 requests x 128 tokens in -> 64 out at temperature 1. Each run is a fresh process (the engine started,
one untimed run to compile, then one timed), the splits alternating (default: even and auto). Next to each run:
every stage's busy time (its step trace, from its inputs in hand to its output sent) over the run's wall time:
the split's balance.

    python benchmarks/partition_bench.py                 # 2 pairs of runs
    python benchmarks/partition_bench.py --repeats 3 --json /tmp/partition.json
    python benchmarks/partition_bench.py --splits even 17,13 16,14 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 64
GOAL = 1.15


def one_run(partition: str) -> dict:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pipejax_benchmarks.sections.common import engine_kwargs, prompts

    from pipejax.ray_executor import LLM, SamplingParams

    llm = LLM(None, pipeline_parallel_size=2, distributed_executor_backend="ray", pin_stage_cpus=True,
              pp_layer_partition=None if partition == "even" else partition, cpu_kernel_build="wait",
              **engine_kwargs())
    try:
        batch = [{"prompt_token_ids": p} for p in prompts(NUM_PROMPTS, INPUT_LEN, llm.engine.model_config.vocab_size)]
        params = SamplingParams(temperature=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        llm.generate(batch, params)  # compiles this workload's shapes
        before = len(llm.engine.executor.step_trace())
        start = time.perf_counter()
        outputs = llm.generate(batch, params)
        wall = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outputs)
        trace = llm.engine.executor.step_trace()[before:]
        busy = [sum(e - s for r, _, s, e in trace if r == rank) / wall for rank in range(2)]
        layers = [info.layers for info in llm.engine.executor.stage_infos()]
        return {"partition": partition, "split": [b - a for a, b in layers], "tok_s": NUM_PROMPTS * OUTPUT_LEN / wall,
                "wall_s": wall, "stage_busy": busy}
    finally:
        llm.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="rounds of runs (one per split), alternating")
    ap.add_argument("--splits", nargs="+", default=["even", "auto"],
                    help="--pp-layer-partition values (even: the default rule); each against the first")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a single run in this process: "even" or "auto"
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one)), flush=True)
        return
    runs = []
    for r in range(args.repeats):
        for partition in args.splits if r % 2 == 0 else args.splits[::-1]:
            proc = subprocess.run([sys.executable, __file__, "--one", partition], capture_output=True, text=True,
                                  timeout=1200)
            if proc.returncode != 0:
                raise RuntimeError(f"the {partition} run failed:\n{proc.stderr[-4000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    by = {p: [r for r in runs if r["partition"] == p] for p in args.splits}
    base = args.splits[0]
    ratios = {p: [a["tok_s"] / e["tok_s"] for a, e in zip(by[p], by[base], strict=True)] for p in args.splits[1:]}
    med = statistics.median
    print(f"pp=2, {NUM_PROMPTS} requests x {INPUT_LEN} in -> {OUTPUT_LEN} out, 2 batches in flight, stages pinned to "
          f"their own cores, {args.repeats} pair(s)")
    print("| split | layers per stage | output tok/s | stage busy (of wall): 0, 1 |\n|---|---|---|---|")
    for p, rs in by.items():
        print(f"| {p} | {rs[0]['split']} | {med(r['tok_s'] for r in rs):.1f} [{min(r['tok_s'] for r in rs):.1f}-"
              f"{max(r['tok_s'] for r in rs):.1f}] | {med(r['stage_busy'][0] for r in rs):.2f}, "
              f"{med(r['stage_busy'][1] for r in rs):.2f} |")
    for p, rs in ratios.items():
        print(f"{p} / {base}: {med(rs):.3f}x [{min(rs):.3f}-{max(rs):.3f}] (goal for auto / even: >= {GOAL}x)")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "ratio": ratios}, indent=1))


if __name__ == "__main__":
    main()
