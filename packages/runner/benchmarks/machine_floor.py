"""This machine's floor under a decode step, measured once for every benchmark that sets a step against it: the
timer, the fp32 matmul rate and the resident read bandwidth (the floor's denominators), and a decode step's
FLOPs and bytes (its numerators). ``decode_bench.py`` next to it uses them, and so do the benchmark report's
sections (benchmarks/pipejax_benchmarks/sections, which import this file by its path) and the probes.

floor = max(FLOPs / matmul rate, (weight bytes + K/V bytes) / bandwidth)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CONTEXT = 128  # tokens already in the cache of every request when the timed decode steps run


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def matmul_rate(repeats: int = 5) -> float:
    """FLOP/s of a 2048^3 fp32 matmul in JAX, the median of ``repeats``."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((2048, 2048), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    return 2 * 2048**3 / statistics.median(timed(lambda: matmul(a).block_until_ready(), repeats))


def machine_rates(repeats: int = 5, references: bool = True) -> dict[str, float]:
    """This machine's fp32 matmul rate (FLOP/s, 2048^3 in JAX) and resident read bandwidth (bytes/s), each
    the median of ``repeats`` — the floor's denominators (a decode step streams its weights and K/V: reads).

    Bandwidth: a JAX reduction over a resident 1 GiB array (no output buffer to fault in). With ``references``,
    next to numpy's reduction over the same resident bytes, split over as many threads as this process has cores,
    as XLA does (``numpy_bandwidth``, the reference it must agree with), and numpy's copy between two resident
    1 GiB buffers (``numpy_copy_bandwidth``, read + write counted), for comparison: a copy into another buffer also
    reads each destination line before writing it (write-allocate), so it shows about what one read stream does."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    flops = matmul_rate(repeats)
    n = 256 * 1024 * 1024  # 1 GiB of fp32
    resident = [jnp.ones((n,), jnp.float32)]
    total = jax.jit(jnp.sum)
    t_bw = statistics.median(timed(lambda: total(resident[0]).block_until_ready(), repeats))
    resident.clear()  # free it before numpy's two buffers
    rates = {"flops": flops, "bandwidth": 4 * n / t_bw}
    if not references:
        return rates
    src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)  # both written once: resident
    # numpy's reduction releases the GIL: one thread per core JAX's own reduction may use, each over its part
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parts = np.array_split(src, threads)
    with ThreadPoolExecutor(threads) as pool:
        t_np = statistics.median(timed(lambda: list(pool.map(np.add.reduce, parts)), repeats))
    t_copy = statistics.median(timed(lambda: np.copyto(dst, src), repeats))
    return {**rates, "numpy_bandwidth": 4 * n / t_np, "numpy_copy_bandwidth": 2 * 4 * n / t_copy}


def step_cost(cfg, batch: int, context: int = CONTEXT) -> tuple[float, float]:
    """(FLOPs, bytes of weights read) of one decode step of the whole model at ``batch``. A Mixture-of-Experts
    layer (``cfg.moe``) counts its router and top_k experts' FLOPs per token (the useful work, not the runner's
    dense formulation of every expert), and the bytes of the experts ``batch`` tokens touch when routed uniformly:
    X (1 - (1 - k / X)^batch) of X."""
    E, F, H, K, D, V, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.vocab_size, cfg.num_layers)
    attention_params = E * H * D + 2 * E * K * D + H * D * E
    moe = getattr(cfg, "moe", None)
    sparse = sum(moe.is_sparse(i) for i in range(L)) if moe else 0
    dense_mlp = (L - sparse) * 3 * E * F
    if sparse:
        X, k, Fm = moe.num_experts, moe.top_k, moe.intermediate_size
        touched = X * (1 - (1 - k / X) ** batch)
        shared = 3 * E * moe.shared_expert_size + E if moe.shared_expert_size else 0
        flop_params = L * attention_params + dense_mlp + sparse * (E * X + k * 3 * E * Fm + shared)
        read_params = L * attention_params + dense_mlp + sparse * (E * X + touched * 3 * E * Fm + shared)
    else:
        flop_params = read_params = L * attention_params + dense_mlp
    attention = L * 4 * batch * H * D * context
    bytes_read = 4 * (read_params + E * V + L * 2 * E + E) + 4 * batch * E  # + LM head; the embedding is a lookup
    return 2 * batch * (flop_params + E * V) + attention, bytes_read


def kv_bytes(cfg, batch: int, slots: int) -> int:
    """K and V bytes of ``slots`` context positions for ``batch`` rows, all layers (fp32)."""
    return 2 * cfg.num_layers * batch * slots * cfg.num_kv_heads * cfg.head_dim * 4
