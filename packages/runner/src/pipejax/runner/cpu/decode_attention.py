"""Decode attention on XLA:CPU as a hand-written kernel: an XLA FFI custom call compiled by numba.

XLA:CPU compiles the block-table gather of ``model.decode_attention`` to loop code that reads K/V at
a fraction of the machine's bandwidth (BENCHMARKS.md, decode section). The kernel
(``cpu_decode_kernel``) walks each row's block table itself and reads every K and V slot it needs once,
straight from the cache buffers: one pass for the scores of all query heads that share a KV head, one
for the weighted values. The rows (and, when there are few, their KV heads) are spread over numba's threads
on TBB (the ``tbb`` wheel; one thread, with a warning, where it cannot be loaded); a call of little context
stays on the calling thread.

Nothing is compiled at install time: the first decode step traced on a CPU stage imports numba and
builds the handler (cached on disk); if that fails, a warning says so and XLA's formulation is traced
instead (the runner's ``decode_attention`` still names the kernel: it is chosen before the first trace).
Used only on CPU, for float32 caches (with tp > 1, each device runs it on its own heads under
``shard_map``); anything else keeps the XLA formulation.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pipejax.pp_utils import TP_AXIS
from pipejax.runner.cpu.build import build_and_register
from pipejax.runner.cpu.sharded import CACHE_SPEC, on_each_device
from pipejax.runner.model import decode_attention

KERNEL = "pipejax.runner.cpu.decode_kernel"  # the numba module that builds the handler
TARGET = "pipejax_paged_decode_attention"


def available() -> bool:
    """Whether numba is installed (found, not imported: it loads only when a CPU stage first needs it)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _handler() -> Any:
    """Build and register the handler once (cached: it lives as long as the process); None (with a warning)
    where numba cannot build it."""
    return build_and_register(TARGET, KERNEL, "decode-attention", "XLA's formulation")


def prepare() -> bool:
    """Build (or load from numba's cache) the kernel now rather than at the first decode trace; whether it
    is available. For callers that time compiles and want the kernel's own build kept out of them."""
    return _handler() is not None


def usable(dtype, devices: list[jax.Device]) -> bool:
    """Whether a stage on ``devices`` with a cache of ``dtype`` can use the kernel: CPU devices, float32."""
    return all(d.platform == "cpu" for d in devices) and jnp.dtype(dtype) == jnp.float32 and available()


def for_mesh(mesh: Mesh) -> Callable:
    """The kernel for a stage on ``mesh`` (``sharded.on_each_device``): over ``tp`` devices each runs it on its own
    heads, the queries split over heads and the cache over KV heads as the model shards them; the rows' block
    tables and positions whole on each, the sliding window static (and ``heads``, for one device only: over tp
    devices q_rows is [R, H, D])."""
    heads = P(None, TP_AXIS, None)  # q_rows [R, H, D], and the result
    return on_each_device(paged_decode_attention, mesh, (heads, CACHE_SPEC, CACHE_SPEC, P(), P(), P()), heads)


def paged_decode_attention(q_rows, k_cache, v_cache, layer, block_tables, start_pos, sliding_window,
                           heads: int | None = None):
    """Rows of one query token each. q_rows [R, H, D]; k_cache/v_cache [L, N, block_size, K, D] (whole:
    a layer slice would be a copy); layer: scalar; block_tables [R, B]; start_pos [R]; sliding_window: None or
    0 for none. ``heads``: q_rows is a layer's qkv rows [R, K (G + 2), D] (per KV head its G query heads, its key,
    its value) and H = ``heads``; the kernel reads the query heads where they are (XLA would copy them out
    first). Returns [R, H, D]."""
    R, _, D = q_rows.shape
    H = heads or q_rows.shape[1]
    if _handler() is None:
        if heads:
            K = k_cache.shape[3]
            q_rows = q_rows.reshape(R, K, -1, D)[:, :, :H // K].reshape(R, H, D)
        return decode_attention(q_rows, k_cache[layer], v_cache[layer], jnp.arange(R), start_pos, block_tables,
                                sliding_window or None)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((R, H, D), jnp.float32))
    ints = (jnp.asarray(layer, jnp.int32), block_tables.astype(jnp.int32), start_pos.astype(jnp.int32))
    return call(q_rows.astype(jnp.float32), k_cache, v_cache, *ints, jnp.int32(sliding_window or 0))
