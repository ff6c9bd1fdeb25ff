"""How much of the 2048-token prefill step (16 prompts x 128 tokens, the decode section's) is attention: the
jitted forward as it is, then with ``model.prefill_attention`` replaced by a stub of the same shape (zeros that
depend on q, so nothing is folded away), each next to JAX's 2048^3 matmul rate measured right after it.

    python benchmarks/probes/prefill_attention_share.py as-is
    python benchmarks/probes/prefill_attention_share.py no-attention

Run the two in separate processes (alternate them). Measured 2026-12-01, three runs each, with the prefill
attention as it was then (dense over the whole [query, context] block): as is 1884 / 1928 / 1994 ms (0.80 /
0.84 / 0.88 of the matmul rate measured after it); without attention 1604 / 1593 / 1642 ms (1.01 / 0.97 /
0.96): the attention took 300-350 ms. With the chunked attention of ``model.prefill_attention`` (query chunks
scoring only the context a right-aligned row can see, GQA heads as one operand), alternated, three runs each,
on a noisier afternoon: as is 1761 / 1737 / 1987 ms, without attention 1714 / 1760 / 1697 ms (the matmul rate
probe read 103-198 GFLOP/s in these runs, so the shares are not worth quoting; the forward times are): the
attention now takes well under 100 ms of the step in two of three pairs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "runner" / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from decode_floor import DecodeBench, bench_model, prefill_flops  # noqa: E402  (the runner's benchmarks)

from pipejax.runner import model  # noqa: E402


def stub_attention(q, k_layer, v_layer, query_start, start_pos, block_tables, query_len, sliding_window):
    return jnp.zeros((block_tables.shape[0], query_len, *q.shape[1:]), q.dtype) + q[0, 0, 0]


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "as-is"
    if mode not in ("as-is", "no-attention"):
        raise SystemExit(f"mode {mode!r}: use as-is or no-attention")
    if mode == "no-attention":
        model.prefill_attention = stub_attention  # looked up when the step is traced
    bench = DecodeBench(bench_model(), [16])
    forward = bench.prefill_forward()
    forward()  # compile
    t = median_seconds(forward, 5)
    a = jnp.ones((2048, 2048), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    rate = 2 * 2048**3 / median_seconds(lambda: matmul(a).block_until_ready(), 5)
    useful = prefill_flops(bench.cfg)
    print(f"{mode}: prefill forward {t * 1e3:.0f} ms, {useful / 1e9:.0f} useful GFLOP at {useful / t / 1e9:.0f} "
          f"GFLOP/s; matmul {rate / 1e9:.0f} GFLOP/s; share {useful / t / rate:.2f}")


if __name__ == "__main__":
    main()
