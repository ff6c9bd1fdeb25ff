"""Timing each CPU kernel against XLA's formulation of the same operation, on a stage's own shapes, on the host
at hand (``select`` decides from these). Each probe compiles both, then times them alternately, so that both
see the same machine load; the figures are each one's least time in milliseconds (a busy neighbour only adds
time: on a shared 2-core AMD EPYC, the dense kernel's median of five rounds at 64 rows ranged 0.65-1.24x XLA's over
nine probes, its least of fifteen 0.63-0.72x over three; 2026-12-07).

Shapes: the dense probe is an MLP's gate/up matmul (a decoder layer's largest) at the stage's most decode rows
and at its largest prefill step; the attention probes are the stage's per-device heads over a paged cache,
decode rows at ``DECODE_CONTEXT`` tokens of context and one prefill row of the largest prefill step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.runner.config import ModelConfig
from pipejax.runner.model import decode_attention, kv_heads_for_tp, prefill_attention
from pipejax.runner.panels import PANEL, swiglu

ROUNDS = 5
DECODE_CONTEXT = 256  # tokens each decode row attends to in the probe (capped by max_model_len)
BLOCK = 16


def alternated_ms(candidates: dict[str, Callable[[], jax.Array]], rounds: int = ROUNDS) -> dict[str, float]:
    """The least milliseconds of each of ``candidates`` (thunks returning an array) over ``rounds``, after one
    untimed call each (its compile), timed in alternation."""
    for fn in candidates.values():
        fn().block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn().block_until_ready()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * min(t) for name, t in times.items()}


def _random(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.05) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)


def dense(cfg: ModelConfig, rows: int, device: jax.Device, xla_panels: bool = True) -> dict[str, float]:
    """x [rows, E] through a gate/up weight [E, 2F] and silu(gate) * up: the dense kernel over panels against
    XLA's dot over the weight's own layout; with ``xla_panels``, XLA's dot over the panels too (what a stage in
    panels runs for the larger calls where the kernel is slower there: only the prefill rows ask); where this
    process can use AMX's tiles, the kernel on them too, splitting the weight at each call ("amx") and over its
    tiles split once ("amx_kept")."""
    from pipejax.runner.cpu import dense as cpu_dense

    E, F = cfg.hidden_size, max(PANEL, -(-cfg.intermediate_size // PANEL) * PANEL)  # whole panels
    rng = np.random.default_rng(0)
    with jax.default_device(device):
        x, w = _random(rng, (rows, E), 1.0), _random(rng, (E, 2 * F))
        panels = jnp.asarray(np.ascontiguousarray(np.asarray(w).reshape(E, -1, PANEL).transpose(1, 0, 2)))[None]
        kernel = jax.jit(lambda x, p: cpu_dense.matmul(x, p, 0, gated=True))
        xla = jax.jit(lambda x, w: swiglu(x @ w[:, :F], x @ w[:, F:]))
        candidates = {"kernel": lambda: kernel(x, panels), "xla": lambda: xla(x, w)}
        if xla_panels:
            over_panels = jax.jit(lambda x, p: cpu_dense.matmul(x, p, 0, gated=True, xla_rows=1))
            candidates["xla_panels"] = lambda: over_panels(x, panels)
        if cpu_dense.amx_ready() and E % PANEL == 0:
            amx = jax.jit(lambda x, p: cpu_dense.matmul(x, p, 0, gated=True, amx_rows=1))
            kept = jax.jit(lambda x, p, t: cpu_dense.matmul(x, p, 0, gated=True, kept_rows=1, tiles=t))
            tiles = cpu_dense.weight_tiles(panels)
            candidates["amx"] = lambda: amx(x, panels)
            candidates["amx_kept"] = lambda: kept(x, panels, tiles)
        return alternated_ms(candidates)


def _cache(cfg: ModelConfig, tp: int, rows: int, context: int, rng: np.random.Generator):
    """A one-layer paged cache holding ``rows`` rows of ``context`` slots each, their block tables, and the
    per-device query heads."""
    kv = kv_heads_for_tp(cfg, tp) // tp
    heads, D = max(1, cfg.num_heads // tp), cfg.head_dim
    per_row = math.ceil(context / BLOCK)
    k, v = (_random(rng, (1, 1 + rows * per_row, BLOCK, kv, D), 1.0) for _ in range(2))
    tables = jnp.asarray(1 + np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row))
    return k, v, tables, heads, D


def decode_attention_ms(cfg: ModelConfig, tp: int, rows: int, context: int, device: jax.Device) -> dict[str, float]:
    """``rows`` decode rows attending to ``context`` cached tokens each: the decode kernel against
    ``model.decode_attention``."""
    from pipejax.runner.cpu import decode_attention as kernel

    rng = np.random.default_rng(1)
    with jax.default_device(device):
        k, v, tables, H, D = _cache(cfg, tp, rows, context, rng)
        q = _random(rng, (rows, H, D), 1.0)
        start = jnp.full((rows,), context - 1, jnp.int32)
        first = jnp.arange(rows, dtype=jnp.int32)
        fast = jax.jit(lambda q, k, v, t, s: kernel.paged_decode_attention(q, k, v, 0, t, s, 0))
        xla = jax.jit(lambda q, k, v, t, s: decode_attention(q, k[0], v[0], first, s, t, None))
        return alternated_ms({"kernel": lambda: fast(q, k, v, tables, start),
                              "xla": lambda: xla(q, k, v, tables, start)})


def prefill_attention_ms(cfg: ModelConfig, tp: int, tokens: int, device: jax.Device) -> dict[str, float]:
    """One prefill row of ``tokens`` tokens attending causally to itself: the prefill kernel against
    ``model.prefill_attention``."""
    from pipejax.runner.cpu import prefill_attention as kernel

    rng = np.random.default_rng(2)
    with jax.default_device(device):
        k, v, tables, H, D = _cache(cfg, tp, 1, tokens, rng)
        q = _random(rng, (tokens, H, D), 1.0)
        zero = jnp.zeros((1,), jnp.int32)
        fast = jax.jit(lambda q, k, v, t: kernel.paged_prefill_attention(q, k, v, 0, zero, zero, t, tokens, 0))
        xla = jax.jit(lambda q, k, v, t: prefill_attention(q, k[0], v[0], zero, zero, t, tokens, None))
        return alternated_ms({"kernel": lambda: fast(q, k, v, tables), "xla": lambda: xla(q, k, v, tables)})
