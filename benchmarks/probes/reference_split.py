"""Where transformers' time goes on the throughput section's workload (64 requests x 128 in x 64 out, greedy, fp32,
its batched ``generate`` on the benchmark model): ``generate`` of 1 token (the prefill, and one sample) against
``generate`` of all 64, alternating, in one process; the difference over 63 is its decode step. pipejax's own split
is the section's breakdown (``--json``: ``breakdown.prefill`` and ``breakdown.decode``).

    python benchmarks/probes/reference_split.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    from pipejax_benchmarks.sections.common import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN, bench_model, prompts
    from pipejax_benchmarks.sections.throughput import HFReference

    hf = HFReference(bench_model())
    batch = prompts(NUM_PROMPTS, INPUT_LEN, hf.model.config.vocab_size)
    hf.run(batch[:2], 4, greedy=True)  # warm-up
    first, whole = [], []
    for r in range(args.rounds):
        for n in ((1, OUTPUT_LEN) if r % 2 == 0 else (OUTPUT_LEN, 1)):
            (first if n == 1 else whole).append(hf.run(batch, n, greedy=True))
        print(f"round {r + 1}: generate of 1 token {first[-1]:.2f} s, of {OUTPUT_LEN} {whole[-1]:.2f} s "
              f"({NUM_PROMPTS * OUTPUT_LEN / whole[-1]:.1f} tokens/s)", flush=True)
    prefill, total = statistics.median(first), statistics.median(whole)
    print(f"median: prefill (generate of 1 token) {prefill:.2f} s, the {OUTPUT_LEN - 1} decode steps after "
          f"{total - prefill:.2f} s ({(total - prefill) / (OUTPUT_LEN - 1) * 1e3:.1f} ms a step); torch threads "
          f"{hf.threads}")


if __name__ == "__main__":
    main()
