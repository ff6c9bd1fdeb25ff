"""The CPU dense kernel over weights kept quantized (``cpu.quantized_dense``, issue 41) against the float32 panel
kernel (``cpu.dense``), side by side in one process: SmolLM2-135M's dense shapes, batch 1 and 64. A probe.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/probes/quantized_dense_probe.py [--rows 1 64] [--repeats 15] [--json OUT]

Shapes (hidden 576, MLP 1536, 9 query and 3 K/V heads of 64): qkv 576 -> 960 (plain), gate_up 576 -> 2 x 1536
(gated: silu(gate) * up out of the kernel), down 1536 -> 576 (added to a residual in place), as a decoder layer
calls them. Every weight has all 30 layers stacked, as a layer scan hands the kernels; one timed call is a
``fori_loop`` of 30 matmuls whose input depends on the last one's output (nothing is hoisted), over either
- ``cycling``: layer i at step i (the decode step's case: every layer's weights read once, from memory: 30 layers
  of fp32 are 384 MB here), or
- ``hot``: layer 0 thirty times (its weights in cache once the first step has read them).
The formats (Q8_0, Q4_0, Q4_1, INT8, and fp32 panels) run in turn, round after round; the table shows each one's
median time per matmul [min-max], its weight bytes read per second, and fp32's time over its own (the speed-up), of
the medians and of the minima. The host's load average is printed before and after: other processes stretch
the wall clock (the minima are then the better figure), and on a 2-core host one busy core takes half the kernels'
threads (``NUMBA_NUM_THREADS=1`` runs both kernels on one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.runner import quantized
from pipejax.runner.cpu import dense as cpu_dense
from pipejax.runner.cpu import quantized_dense
from pipejax.runner.panels import PANEL

LAYERS = 30
# name: (K, N, mode) of SmolLM2-135M's dense weights (N: the kernel's outputs, both halves for gate_up)
SHAPES = {"qkv": (576, 960, "plain"), "gate_up": (576, 2 * 1536, "gated"), "down": (1536, 576, "residual")}
FORMATS = ("fp32", "q8_0", "q4_0", "q4_1", "int8")
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    """The CPU's model name and which of ``CPU_FLAGS`` /proc/cpuinfo lists."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "cores": cores, "flags": {f: f in flags for f in CPU_FLAGS}}


def weights(fmt_name: str, k: int, n: int, rng: np.random.Generator):
    """Random panels of LAYERS layers: fp32 [L, P, K, 32], or (q, scale, offset) of a quantized format."""
    p = n // PANEL
    if fmt_name == "fp32":
        return (jnp.asarray(rng.standard_normal((LAYERS, p, k, PANEL), np.float32) * np.float32(0.02)),)
    fmt = quantized.FORMATS[fmt_name]
    blocks = k // fmt.block_of(k)
    if fmt.bits == 8:
        q = rng.integers(-127, 128, (LAYERS, p, k, PANEL), dtype=np.int8)
    else:
        q = rng.integers(0, 256, (LAYERS, p, k // 2, PANEL), dtype=np.uint8)
    scale = rng.uniform(0.0, 0.02 / 64, (LAYERS, p, blocks, PANEL)).astype(np.float32)
    offset = (-8 * scale) if fmt.offset else None
    return jnp.asarray(q), jnp.asarray(scale), None if offset is None else jnp.asarray(offset)


def nbytes(ws) -> int:
    """Bytes of one layer's weight."""
    return sum(int(w.nbytes) for w in ws if w is not None) // LAYERS


def layer_loop(fmt_name: str, k: int, n: int, mode: str, cycling: bool):
    """A jitted (x, residual, *weights) -> x: LAYERS matmuls (layer i, or layer 0), each one's input depending on
    the last one's output."""

    def mm(x, ws, layer, residual):
        gated = mode == "gated"
        res = residual if mode == "residual" else None
        if fmt_name == "fp32":
            return cpu_dense.matmul(x, ws[0], layer, gated, res)
        return quantized_dense.matmul(x, *ws, quantized.FORMATS[fmt_name], layer, gated, res)

    def run(x, residual, *ws):
        def body(i, carry):
            x, residual = carry
            y = mm(x, ws, i if cycling else 0, residual)
            small = np.float32(1e-6) * y[:, :k]
            x = x + small if small.shape[1] == k else x.at[:, :small.shape[1]].add(small)
            return x, y if mode == "residual" else residual

        return jax.lax.fori_loop(0, LAYERS, body, (x, residual))[0]

    return jax.jit(run)


def measure(rows_list, repeats: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    results = []
    for shape, (k, n, mode) in SHAPES.items():
        stacks = {f: weights(f, k, n, rng) for f in FORMATS}
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
            residual = jnp.asarray(rng.standard_normal((rows, n if mode == "residual" else 1), np.float32))
            for cycling in (True, False):
                runs = {f: layer_loop(f, k, n, mode, cycling) for f in FORMATS}
                for f in FORMATS:  # compile and warm up
                    runs[f](x, residual, *stacks[f]).block_until_ready()
                times = {f: [] for f in FORMATS}
                for _ in range(repeats):
                    for f in FORMATS:
                        start = time.perf_counter()
                        runs[f](x, residual, *stacks[f]).block_until_ready()
                        times[f].append((time.perf_counter() - start) / LAYERS)
                fp32, fp32_min = statistics.median(times["fp32"]), min(times["fp32"])
                for f in FORMATS:
                    t = statistics.median(times[f])
                    results.append({"shape": shape, "K": k, "N": n, "mode": mode, "rows": rows,
                                    "layers": "cycling" if cycling else "hot", "format": f, "us": t * 1e6,
                                    "us_min": min(times[f]) * 1e6, "us_max": max(times[f]) * 1e6,
                                    "bytes": nbytes(stacks[f]), "gb_s": nbytes(stacks[f]) / t / 1e9,
                                    "speedup": fp32 / t, "speedup_min": fp32_min / min(times[f])})
        del stacks
    return results


def table(results: list[dict]) -> str:
    lines = [f"{'shape':8} {'rows':>4} {'layers':8} {'format':6} {'us/matmul':>10} {'[min-max]':>18} "
             f"{'KB/layer':>9} {'GB/s':>6} {'fp32/this':>9} {'(of minima)':>11}"]
    for r in results:
        lines.append(f"{r['shape']:8} {r['rows']:>4} {r['layers']:8} {r['format']:6} {r['us']:>10.1f} "
                     f"{'[' + format(r['us_min'], '.1f') + '-' + format(r['us_max'], '.1f') + ']':>18} "
                     f"{r['bytes'] / 1024:>9.0f} {r['gb_s']:>6.1f} {r['speedup']:>9.2f} {r['speedup_min']:>11.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    info = cpu_info()
    import numba

    threads = numba.config.NUMBA_NUM_THREADS
    print(f"CPU: {info['model']}, {info['cores']} cores; flags: "
          + " ".join(f for f, present in info["flags"].items() if present)
          + f"; numba threads: {threads}")
    if not (cpu_dense.prepare() and quantized_dense.prepare()):
        raise SystemExit("a CPU kernel could not be built: nothing to compare")
    load = [os.getloadavg()]
    print(f"load average before: {load[0][0]:.2f}", flush=True)
    results = measure(args.rows, args.repeats)
    load.append(os.getloadavg())
    print(table(results))
    print(f"load average after: {load[1][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": info, "numba_threads": threads, "layers": LAYERS,
                                         "repeats": args.repeats, "load_average": [a[0] for a in load],
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
