"""A step's dense matmuls on the CPU dense kernel, called directly (no XLA): the benchmark model's 12 layers, each
q/k/v [768 -> 1280], o [768 -> 768, added to the residual], gate/up with SiLU [768 -> 2 x 2048] and down
[2048 -> 768, added], at a decode batch (64 rows) and a prefill chunk (512 rows). Every layer's weights distinct, so
that each comes from memory as in a step (``--distinct 1``: one layer's weights for all 12, from the caches).
Milliseconds per step and per call kind, and GFLOP/s, over numba's threads. Run it under two source trees
(``PYTHONPATH``) in turn to compare kernels side by side.

    python benchmarks/probes/dense_kernel_blocks.py [--rows 64 512] [--distinct 12] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

LAYERS, E, QKV, F = 12, 768, 1280, 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--distinct", type=int, choices=[1, 2, 3, 4, 6, 12], default=LAYERS)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from pipejax.runner.cpu import dense_kernel as kernel

    rng = np.random.default_rng(0)

    def panels(kc: int, n: int) -> np.ndarray:
        return (rng.random((n // 32, kc, 32), dtype=np.float32) - 0.5) * 0.02

    layers = [(panels(E, QKV), panels(E, E), panels(E, 2 * F), panels(F, E))
              for _ in range(args.distinct)] * (LAYERS // args.distinct)
    flop_per_row = 2 * LAYERS * (E * QKV + E * E + E * 2 * F + F * E)
    for rows in args.rows:
        h, attn = rng.random((rows, E), dtype=np.float32), rng.random((rows, E), dtype=np.float32)
        qkv, act = np.empty((rows, QKV), np.float32), np.empty((rows, F), np.float32)
        calls = {  # name: (kernel, x, out, contraction, panels, its last argument)
            "qkv": (kernel._matmul_parallel, h, qkv, E, QKV // 32, False),
            "o": (kernel._matmul_parallel, attn, h, E, E // 32, True),
            "gate_up": (kernel._glu_parallel, h, act, E, 2 * F // 32, None),
            "down": (kernel._matmul_parallel, act, h, F, E // 32, True),
        }
        spent = dict.fromkeys(calls, 0.0)

        def step(rows=rows, calls=calls, spent=spent) -> None:
            for weights in layers:
                for (name, (fn, x, out, kc, n_panels, last)), w in zip(calls.items(), weights, strict=True):
                    start = time.perf_counter()
                    tail = () if last is None else (last,)
                    fn(x.ctypes.data, w.ctypes.data, out.ctypes.data, rows, kc, n_panels, *tail)
                    spent[name] += time.perf_counter() - start

        step()  # numba's compile (or cache load)
        spent.update(dict.fromkeys(calls, 0.0))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        print(f"rows {rows}: {median * 1e3:.1f} ms a step (median of {args.rounds}), "
              f"{flop_per_row * rows / median / 1e9:.0f} GFLOP/s; per step "
              + ", ".join(f"{name} {t / args.rounds * 1e3:.1f}" for name, t in spent.items()), flush=True)


if __name__ == "__main__":
    main()
