"""A mixed step's prefill rows with their own block bucket (``StepShape.prefill_blocks``) against the step's
full block-table width, on the same inputs in one process, alternated.

The step: 16 decode rows at context 128 (12 blocks of 16 in the table bucket; the decode group padded to 64
rows, as the engine pads it with max_num_seqs 64) beside 16 fresh 127-token prompts (8 blocks would do), as in
the headline workload's second prefill step.

    python benchmarks/probes/mixed_step_blocks.py

Measured 2026-12-02 09:50 UTC (2-CPU AMD EPYC, six alternated rounds): prefill blocks 8: 1867 ms (min 1850);
all 12: 1985 ms (min 1970).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "runner" / "benchmarks"))
from decode_floor import DecodeBench, bench_model  # noqa: E402  (the runner's benchmarks)

from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest  # noqa: E402

DECODE_ROWS, PREFILL_ROWS, CONTEXT, PROMPT, ROUNDS = 16, 16, 128, 127, 6
MAX_ROWS = 64  # the engine's max_num_seqs in the headline workload: the decode group's bucket in a mixed step


def main() -> None:
    bench = DecodeBench(bench_model(), [MAX_ROWS])
    runner, per = bench.runner, bench.per_request
    sampling = SamplingParams(temperature=1.0)

    def table(i: int) -> tuple[int, ...]:
        return tuple(range(1 + i * per, 1 + (i + 1) * per))

    reqs = [ScheduledRequest(f"d{i}", (7,), CONTEXT, table(i), sampling) for i in range(DECODE_ROWS)]
    reqs += [ScheduledRequest(f"p{i}", tuple(range(5, 5 + PROMPT)), 0, table(i), sampling)
             for i in range(DECODE_ROWS, DECODE_ROWS + PREFILL_ROWS)]
    shape, inputs = runner.prepare_inputs(ModelBatch(0, tuple(reqs)))
    variants = {f"prefill blocks {shape.prefill_blocks}": shape,
                f"all {shape.blocks}": shape._replace(prefill_blocks=0)}
    print(shape)
    for v in variants.values():  # compile
        runner.forward(inputs, v).block_until_ready()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for name, v in variants.items():
            start = time.perf_counter()
            runner.forward(inputs, v).block_until_ready()
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name}: {statistics.median(t) * 1e3:.0f} ms (min {min(t) * 1e3:.0f})")


if __name__ == "__main__":
    main()
