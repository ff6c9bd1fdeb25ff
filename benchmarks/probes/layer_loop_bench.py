"""How the layer loop reads its weights on XLA:CPU: a ``lax.scan`` over stacked [L, ...] weights (what
``model.stage_forward`` does for prefill steps) against a Python loop over per-layer arrays, and against
static slices of the stacked arrays inside the jit. Twelve Llama-like layers (hidden 768, ffn 2048), fp32,
a batch of 1 and of 64 rows; each line: median of 10 calls and the weight bytes read per second.

    python benchmarks/probes/layer_loop_bench.py

The scan's dynamic slice of each layer's weights is a copy on XLA:CPU (its dots cannot read a slice in
place), so a weight-bound step reads and writes every weight once more than it needs to. Measured
2026-12-01 (2 CPUs, 324 MiB of weights): batch 1, scan 33.5 ms (10.1 GB/s) / per-layer arrays 16.1 ms
(21.1 GB/s) / static slices 109.2 ms; batch 64, 91.9 / 71.6 / 171.0 ms.

The runner's decode steps on CPU therefore run the layers unrolled over per-layer views of the stacked
weights (``pipejax.runner.cpu.layer_views``; ``StageRunner(decode_layers=...)``); its effect on the runner's own
step is in the runner README and BENCHMARKS.md's decode section.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
RUNNER_BENCHMARKS = Path(__file__).resolve().parents[2] / "packages" / "runner" / "benchmarks"
sys.path.insert(0, str(RUNNER_BENCHMARKS))  # the runner's benchmark helpers: the timer

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from machine_floor import timed  # noqa: E402

L, E, F = 12, 768, 2048
SHAPES = {"qkv": (E, 3 * E), "o": (E, E), "gate": (E, F), "up": (E, F), "down": (F, E)}


def layer(x, p):
    x = x + (x @ p["qkv"])[:, :E] @ p["o"]
    return x + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


@jax.jit
def scanned(x, stacked):
    return jax.lax.scan(lambda x, p: (layer(x, p), None), x, stacked)[0]


@jax.jit
def per_layer(x, layers):
    for p in layers:
        x = layer(x, p)
    return x


@jax.jit
def static_slices(x, stacked):
    for i in range(L):
        x = layer(x, {n: w[i] for n, w in stacked.items()})
    return x


def main() -> None:
    rng = np.random.default_rng(0)
    stacked = {n: jnp.asarray(rng.standard_normal((L, *s), np.float32) * 0.02) for n, s in SHAPES.items()}
    layers = [{n: jnp.array(w[i]) for n, w in stacked.items()} for i in range(L)]  # own buffers
    nbytes = sum(w.nbytes for w in stacked.values())
    print(f"{nbytes / 2**20:.0f} MiB of weights, {os.cpu_count()} CPUs")
    for batch in (1, 64):
        x = jnp.ones((batch, E), jnp.float32)
        for name, fn, weights in (("scan over stacked", scanned, stacked), ("loop over per-layer arrays", per_layer,
                                  layers), ("static slices of stacked", static_slices, stacked)):
            t = statistics.median(timed(lambda fn=fn, x=x, w=weights: fn(x, w).block_until_ready(), 10))
            print(f"batch {batch:2d}  {name:27s} {t * 1e3:7.1f} ms  {nbytes / t / 1e9:5.1f} GB/s of weights")


if __name__ == "__main__":
    main()
