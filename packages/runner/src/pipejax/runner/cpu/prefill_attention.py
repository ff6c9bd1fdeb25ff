"""Prefill attention on XLA:CPU as a hand-written kernel: an XLA FFI custom call compiled by numba
(``cpu_prefill_kernel``), for the prefill rows of a step.

XLA:CPU runs ``model.prefill_attention`` as a block-table gather into a contiguous copy, then small batched
matmuls per query chunk (YNNPACK) with the softmax between them. The kernel reads each row's K/V once from the
paged cache and multiplies on the dense kernel's register-tiled microkernel, each tile of queries only as far
into the context as it can see: in a 16 x 128-token prefill (12 layers, 12/4 heads of 64) it took 63-80 ms
against 137-154 ms for XLA's formulation (``/tmp/s34/pk.py``, alternated, one process, 2026-12-03).

Built, like the decode kernel, when a CPU stage first traces a prefill step (cached on disk by numba); where
numba cannot build it, a warning says so and XLA's formulation is traced instead. Used on CPU for float32
caches and a head dim that is a whole number of panels (32); with tp > 1 each device runs it on its own heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pipejax.pp_utils import TP_AXIS
from pipejax.runner.cpu import decode_attention as cpu_decode_attention
from pipejax.runner.cpu.build import build_and_register
from pipejax.runner.cpu.sharded import CACHE_SPEC, on_each_device
from pipejax.runner.model import prefill_attention
from pipejax.runner.panels import PANEL

KERNEL = "pipejax.runner.cpu.prefill_kernel"  # the numba module that builds the handler
TARGET = "pipejax_paged_prefill_attention"


@functools.cache
def _handler() -> Any:
    """Build and register the handler once (it lives as long as the process); None (with a warning) where numba
    cannot build it."""
    return build_and_register(TARGET, KERNEL, "prefill-attention", "XLA's formulation")


def prepare() -> bool:
    """Build (or load from numba's cache) the kernel now; whether it is available."""
    return _handler() is not None


def usable(dtype, head_dim: int, devices: list[jax.Device]) -> bool:
    """Whether a stage on ``devices`` with a cache of ``dtype`` and heads of ``head_dim`` can use the kernel."""
    return head_dim % PANEL == 0 and cpu_decode_attention.usable(dtype, devices)


def for_mesh(mesh: Mesh) -> Callable:
    """The kernel for a stage on ``mesh``, as ``cpu_decode_attention.for_mesh``: q [T, H, D] split over heads, the
    cache over KV heads, the result [R, Q, H, D] over heads; query_len and the sliding window static."""
    in_specs = (P(None, TP_AXIS, None), CACHE_SPEC, CACHE_SPEC, P(), P(), P(), P())  # ..., layer, rows' starts, tables
    return on_each_device(paged_prefill_attention, mesh, in_specs, P(None, None, TP_AXIS))


def paged_prefill_attention(q, k_cache, v_cache, layer, query_start, start_pos, block_tables, query_len,
                            sliding_window):
    """``model.prefill_attention`` over the whole cache: q [T, H, D]; k_cache/v_cache [L, N, block_size, K, D]
    (a layer slice would be a copy); layer: scalar; query_start/start_pos [R] (of query slot 0: rows are
    right-aligned); block_tables [R, B]; sliding_window: None or 0 for none. Returns [R, query_len, H, D]."""
    R, (_, H, D) = block_tables.shape[0], q.shape
    if _handler() is None or D % PANEL:
        return prefill_attention(q, k_cache[layer], v_cache[layer], query_start, start_pos, block_tables, query_len,
                                 sliding_window or None)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((R, query_len, H, D), jnp.float32))
    rows = (block_tables.astype(jnp.int32), query_start.astype(jnp.int32), start_pos.astype(jnp.int32))
    return call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32), *rows,
                jnp.int32(sliding_window or 0))
