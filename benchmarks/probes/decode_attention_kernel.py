"""The CPU decode-attention kernel called directly (no XLA): the benchmark model's shapes (12 query heads over 4 KV
heads of 64, blocks of 16 slots), ``--rows`` rows each seeing ``--context`` slots through a shuffled block table,
one call per layer for 12 layers. Each layer's cache distinct (``--from memory``: 17 MB a layer, read from memory as
in a step) or the same layer's again and again (``--from cache``). Milliseconds per 12 calls, the best of
``--rounds``, over numba's threads. Run it under two source trees (``PYTHONPATH``) in turn to compare kernels.

    python benchmarks/probes/decode_attention_kernel.py [--rows 64] [--context 129] [--from memory cache]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

LAYERS, H, K, D, BLOCK = 12, 12, 4, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=129)
    parser.add_argument("--from", dest="sources", nargs="+", choices=["memory", "cache"], default=["memory", "cache"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from pipejax.runner.cpu import decode_kernel

    rows, per_row = args.rows, -(-args.context // BLOCK)
    blocks = rows * per_row + 1  # block 0 unused, as in the engine's cache
    rng = np.random.default_rng(0)
    shape = (LAYERS, blocks, BLOCK, K, D)
    k_cache, v_cache = (rng.standard_normal(shape, dtype=np.float32).ravel() for _ in range(2))
    tables = rng.permutation(np.arange(1, blocks)).reshape(rows, per_row).astype(np.int32)
    q, start = rng.standard_normal((rows, H, D), dtype=np.float32), np.full(rows, args.context - 1, np.int32)
    out = np.empty_like(q)
    decode_kernel._attend_parallel(q, k_cache, v_cache, shape, 0, tables, start, 0, out)  # numba's compile
    for source in args.sources:
        best = float("inf")
        for _ in range(args.rounds):
            begin = time.perf_counter()
            for layer in range(LAYERS):
                decode_kernel._attend_parallel(q, k_cache, v_cache, shape, layer if source == "memory" else 0,
                                               tables, start, 0, out)
            best = min(best, time.perf_counter() - begin)
        kv_bytes = 2 * rows * args.context * K * D * 4 * LAYERS
        print(f"{rows} rows x {args.context} slots, each layer's cache from {source}: {best * 1e3:.2f} ms per "
              f"{LAYERS} calls ({kv_bytes / best / 1e9:.1f} GB/s of K and V)", flush=True)


if __name__ == "__main__":
    main()
