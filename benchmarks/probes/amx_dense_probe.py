"""The dense kernel on AMX's bf16 tiles (``amx_kernel``: three bf16 pieces a value, six products, fp32 accuracy)
against the same kernel on the FMA tiles, called directly (no XLA), alternating, over ``--weights`` distinct
weights in turn (each from memory, as a step's layers): ms and GFLOP/s (fp32 FLOPs) per call, and each side's
largest error against a float64 matmul. "amx" splits the weight into its tiles at every call; "tiled" reads the
tiles split once beforehand (``amx_kernel.split_panels``: what a stage keeps beside a weight's panels where
``select`` measured that faster). Needs a CPU with ``amx_bf16`` in /proc/cpuinfo. A shape is ``RxKxN``
(rows, contraction, output columns); a ``g`` after it runs the gated MLP form (silu(gate) * up over the halves).

    python benchmarks/probes/amx_dense_probe.py [--shapes 64x768x4096g 512x768x4096g 512x2048x768 512x768x1280]
        [--weights 12] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def compare(shape: str, weights: int, rounds: int, rng: np.random.Generator) -> str:
    from pipejax.runner.cpu import amx_kernel, dense_kernel

    gated = shape.endswith("g")
    m, kc, n = map(int, shape.rstrip("g").split("x"))
    x = rng.standard_normal((m, kc), np.float32)
    ws = [(rng.standard_normal((n // 32, kc, 32)) / np.sqrt(kc)).astype(np.float32) for _ in range(weights)]
    out = np.zeros((m, n // 2 if gated else n), np.float32)

    def fma(w):
        if gated:
            return dense_kernel._glu_parallel(x.ctypes.data, w.ctypes.data, out.ctypes.data, m, kc, n // 32)
        return dense_kernel._matmul_parallel(x.ctypes.data, w.ctypes.data, out.ctypes.data, m, kc, n // 32, False)

    tiles = []
    for w in ws:
        tiles.append(np.empty(n // 32 * kc // 32 * 6 * amx_kernel.TILE + (2 << 20), np.uint8))
        amx_kernel.split_panels(w.ctypes.data, n // 32, kc, tiles[-1].ctypes.data)
    tiles_of = {id(w): t.ctypes.data for w, t in zip(ws, tiles, strict=True)}

    def amx(w, tiled):
        return amx_kernel.matmul_parallel(x.ctypes.data, w.ctypes.data, out.ctypes.data, m, kc, n // 32, gated, False,
                                          tiles_of[id(w)] if tiled else 0)

    calls = {"amx": lambda w: amx(w, False), "tiled": lambda w: amx(w, True), "fma": fma}
    y = x.astype(np.float64) @ ws[0].transpose(1, 0, 2).reshape(kc, n).astype(np.float64)
    exact = y[:, :n // 2] / (1 + np.exp(-y[:, :n // 2])) * y[:, n // 2:] if gated else y
    error = {}
    for name, call in calls.items():
        call(ws[0])
        error[name] = float(np.abs(out - exact).max())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for w in ws:
                call(w)
            times[name].append((time.perf_counter() - start) / len(ws))
    cells = [f"{name} {1e3 * np.median(t):.2f} ms [{1e3 * min(t):.2f}-{1e3 * max(t):.2f}] "
             f"({2 * m * kc * n / np.median(t) / 1e9:.0f} GFLOP/s, error {error[name]:.1e})"
             for name, t in times.items()]
    ratios = " | ".join(f"{name} {np.median(times['fma']) / np.median(times[name]):.2f}x as fast"
                        for name in ("amx", "tiled"))
    return f"{shape}: " + " | ".join(cells) + f" | {ratios}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["64x768x4096g", "512x768x4096g", "512x2048x768",
                                                        "512x768x1280"])
    parser.add_argument("--weights", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from pipejax.runner.cpu import dense

    if not dense.amx_ready():
        raise SystemExit("no AMX bf16 tiles for this process here (amx_bf16 not in /proc/cpuinfo, or not granted)")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        print(compare(shape, args.weights, args.rounds, rng), flush=True)


if __name__ == "__main__":
    main()
