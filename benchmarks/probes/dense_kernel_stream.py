"""The CPU dense kernel called directly (no XLA), its weights from memory or from cache: ``x [rows, 768] @ w [768,
4096]`` over weights in panels, either one weight again and again (it stays in the caches) or ``--copies`` distinct
weights in turn (each comes from memory, as a step's layers do). GFLOP/s of each, per row count, over the kernel's
threads (numba's, all cores).

    python benchmarks/probes/dense_kernel_stream.py [--rows 8 64 512] [--copies 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

KC, N = 768, 4096  # the benchmark model's gate/up as one weight


def per_call(matmul, x, out, weights, reps: int) -> float:
    """Seconds per call, ``weights`` multiplied in turn ``reps`` times."""
    start = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            matmul(x.ctypes.data, w.ctypes.data, out.ctypes.data, x.shape[0], KC, N // 32, False)
    return (time.perf_counter() - start) / (reps * len(weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--copies", type=int, default=24, help="distinct weights cycled (12.6 MB each)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pipejax.runner.cpu import dense_kernel

    matmul = dense_kernel._matmul_parallel
    rng = np.random.default_rng(0)
    weights = [rng.random((N // 32, KC, 32), dtype=np.float32) for _ in range(args.copies)]
    for rows in args.rows:
        x, out = rng.random((rows, KC), dtype=np.float32), np.empty((rows, N), np.float32)
        per_call(matmul, x, out, weights[:1], 1)  # numba's compile (or cache load)
        flop = 2 * rows * KC * N
        for _ in range(args.rounds):
            cached = per_call(matmul, x, out, weights[:1], max(1, 2048 // rows))
            streamed = per_call(matmul, x, out, weights, max(1, 128 // rows))
            print(f"rows {rows}: one weight again {flop / cached / 1e9:.0f} GFLOP/s, {args.copies} weights in turn "
                  f"{flop / streamed / 1e9:.0f} GFLOP/s ({KC * N * 4 / streamed / 1e9:.1f} GB/s of weights)")


if __name__ == "__main__":
    main()
