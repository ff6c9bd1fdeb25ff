"""Decode attention on XLA:CPU as a hand-written kernel: an XLA FFI custom call compiled by numba.

XLA:CPU compiles the block-table gather of ``model.decode_attention`` to loop code that reads K/V at
a fraction of the machine's bandwidth (BENCHMARKS.md, decode section). This kernel walks each row's
block table itself and reads every K and V slot it needs once, straight from the cache buffers: one
pass for the scores of all query heads that share a KV head, one for the weighted values.

The handler speaks XLA's typed FFI C ABI (``xla/ffi/api/c_api.h`` in jaxlib's headers) directly, so
nothing is compiled at install time: numba compiles it on first use (and caches it on disk). Used
only on CPU, for float32 caches (with tp > 1, each device runs it on its own heads under ``shard_map``);
anything else keeps the XLA formulation. ``available()`` says whether numba is installed and the handler builds.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pipejax.pp_utils import TP_AXIS

try:
    import numba
    from numba import types
    from numba.extending import intrinsic
except ImportError:  # numba is optional: without it the XLA formulation is used
    numba = None

log = logging.getLogger(__name__)

TARGET = "pipejax_paged_decode_attention"

# Byte offsets / 8 of the int64 fields read from XLA's FFI structs (64-bit layout of c_api.h).
_FRAME_EXTENSION, _FRAME_STAGE, _FRAME_ARGS, _FRAME_RETS = 1, 4, 9, 14  # XLA_FFI_CallFrame
_BUFFER_DATA, _BUFFER_RANK, _BUFFER_DIMS = 3, 4, 5  # XLA_FFI_Buffer
_EXTENSION_TYPE, _EXTENSION_METADATA = 1, 3  # XLA_FFI_Metadata_Extension: type, then XLA_FFI_Metadata*
_METADATA_MAJOR, _METADATA_MINOR, _METADATA_TRAITS = 6, 7, 8  # int32 fields of XLA_FFI_Metadata
_FFI_API = (0, 3)  # XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR of jaxlib 0.10.2's headers
_STAGE_EXECUTE, _EXTENSION_IS_METADATA = 3, 1
_ARGS = 7  # q, k_cache, v_cache, layer, block_tables, start_pos, sliding_window


@functools.cache
def available() -> bool:
    """Whether the kernel can run here: numba is installed, and the handler compiles and registers."""
    if numba is None:
        return False
    try:
        _register()
    except Exception as e:  # noqa: BLE001 - a numba/LLVM that cannot build it: XLA's formulation stays
        log.warning("the CPU decode-attention kernel is not available (%s: %s); using XLA's formulation",
                    type(e).__name__, e)
        return False
    return True


if numba is not None:

    @intrinsic
    def _ptr(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

        return types.voidptr(types.int64), codegen

    @numba.njit(inline="always")
    def _int64s(addr, n):
        return numba.carray(_ptr(addr), (n,), np.int64)

    @numba.njit(fastmath=True, cache=True)
    def _attend(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out):
        """q [R, H, D]; k_flat/v_flat: caches [L, N, block_size, K, D] (``cache_shape``) flattened; tables
        [R, B]; start_pos [R] -> out [R, H, D]. Walks each row's blocks in order, slot by slot (no division
        per slot), and reads each K/V slot as a contiguous run of D floats (a view per slot costs more)."""
        R, H, D = q.shape
        blocks, block_size, K = cache_shape[1], cache_shape[2], cache_shape[3]
        G = H // K
        context = tables.shape[1] * block_size
        scale = np.float32(1.0 / math.sqrt(D))
        block_stride, layer_base = block_size * K * D, layer * blocks * block_size * K * D
        scores = np.empty((G, context), np.float32)
        qs = np.empty((G, D), np.float32)
        acc = np.empty((G, D), np.float32)
        for r in range(R):
            hi = min(start_pos[r] + 1, context)  # a decode row sees its own position and what precedes it
            lo = max(0, start_pos[r] - window + 1) if window > 0 else 0
            for kh in range(K):
                for g in range(G):
                    for d in range(D):
                        qs[g, d] = q[r, kh * G + g, d] * scale
                for b in range(lo // block_size, (hi - 1) // block_size + 1):
                    block = k_flat[layer_base + tables[r, b] * block_stride:][:block_stride]
                    for c in range(max(lo, b * block_size), min(hi, (b + 1) * block_size)):
                        key = block[(c - b * block_size) * K * D + kh * D:][:D]
                        for g in range(G):
                            s = np.float32(0.0)
                            for d in range(D):
                                s += qs[g, d] * key[d]
                            scores[g, c] = s
                for g in range(G):
                    top = scores[g, lo]
                    for c in range(lo + 1, hi):
                        top = max(top, scores[g, c])
                    for c in range(lo, hi):
                        scores[g, c] = math.exp(scores[g, c] - top)
                acc[:] = 0.0
                for b in range(lo // block_size, (hi - 1) // block_size + 1):
                    block = v_flat[layer_base + tables[r, b] * block_stride:][:block_stride]
                    for c in range(max(lo, b * block_size), min(hi, (b + 1) * block_size)):
                        value = block[(c - b * block_size) * K * D + kh * D:][:D]
                        for g in range(G):
                            p = scores[g, c]
                            for d in range(D):
                                acc[g, d] += p * value[d]
                for g in range(G):
                    total = np.float32(0.0)
                    for c in range(lo, hi):
                        total += scores[g, c]
                    for d in range(D):
                        out[r, kh * G + g, d] = acc[g, d] / total

    @numba.njit(inline="always")
    def _buffer(args, i):
        buf = _int64s(args[i], 6)
        return _ptr(buf[_BUFFER_DATA]), _int64s(buf[_BUFFER_DIMS], buf[_BUFFER_RANK])

    def _handler(frame_addr):  # compiled by _register; returns null: success
        frame = _int64s(frame_addr, 15)
        if frame[_FRAME_EXTENSION] != 0:  # XLA asking for the handler's metadata, not running it
            ext = _int64s(frame[_FRAME_EXTENSION], 4)
            if (ext[_EXTENSION_TYPE] & 0xFFFFFFFF) == _EXTENSION_IS_METADATA:
                meta = numba.carray(_ptr(ext[_EXTENSION_METADATA]), (10,), np.int32)
                meta[_METADATA_MAJOR], meta[_METADATA_MINOR], meta[_METADATA_TRAITS] = _FFI_API[0], _FFI_API[1], 0
                return _ptr(0)
        if (frame[_FRAME_STAGE] & 0xFFFFFFFF) != _STAGE_EXECUTE:
            return _ptr(0)
        args = _int64s(frame[_FRAME_ARGS], _ARGS)
        rets = _int64s(frame[_FRAME_RETS], 1)
        q_data, q_dims = _buffer(args, 0)
        k_data, k_dims = _buffer(args, 1)
        v_data, _ = _buffer(args, 2)
        layer_data, _ = _buffer(args, 3)
        t_data, t_dims = _buffer(args, 4)
        pos_data, _ = _buffer(args, 5)
        window_data, _ = _buffer(args, 6)
        out_data, _ = _buffer(rets, 0)
        q_shape = (q_dims[0], q_dims[1], q_dims[2])
        k_shape = (k_dims[0], k_dims[1], k_dims[2], k_dims[3], k_dims[4])
        k_size = k_dims[0] * k_dims[1] * k_dims[2] * k_dims[3] * k_dims[4]
        _attend(
            numba.carray(q_data, q_shape, np.float32),
            numba.carray(k_data, (k_size,), np.float32),
            numba.carray(v_data, (k_size,), np.float32),
            k_shape,
            numba.carray(layer_data, (1,), np.int32)[0],
            numba.carray(t_data, (t_dims[0], t_dims[1]), np.int32),
            numba.carray(pos_data, (q_dims[0],), np.int32),
            numba.carray(window_data, (1,), np.int32)[0],
            numba.carray(out_data, q_shape, np.float32),
        )
        return _ptr(0)


@functools.cache
def _register() -> Any:
    """Compile the handler (numba caches it on disk: ~3 s the first time, well under 1 s after) and register it."""
    handler = numba.cfunc(types.voidptr(types.int64), cache=True)(_handler)  # XLA_FFI_Error* (XLA_FFI_CallFrame*)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    jax.ffi.register_ffi_target(TARGET, new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None), "cpu")
    return handler  # cached: the compiled code lives as long as the process


def usable(dtype, devices: list[jax.Device]) -> bool:
    """Whether a stage on ``devices`` with a cache of ``dtype`` can use the kernel: CPU devices, float32."""
    return all(d.platform == "cpu" for d in devices) and jnp.dtype(dtype) == jnp.float32 and available()


def for_mesh(mesh: Mesh) -> Callable:
    """The kernel for a stage on ``mesh``: called directly on one device; over ``tp`` devices each runs it on
    its own heads (the cache is sharded over KV heads, the queries over heads, as the model shards them)."""
    if mesh.devices.size == 1:
        return paged_decode_attention
    heads, kv_heads, rep = P(None, TP_AXIS, None), P(None, None, None, TP_AXIS, None), P()

    def sharded(q_rows, k_cache, v_cache, layer, block_tables, start_pos, sliding_window):
        local = functools.partial(paged_decode_attention, sliding_window=sliding_window)
        return jax.shard_map(local, mesh=mesh, in_specs=(heads, kv_heads, kv_heads, rep, rep, rep), out_specs=heads,
                             check_vma=False)(q_rows, k_cache, v_cache, jnp.asarray(layer, jnp.int32), block_tables,
                                              start_pos)

    return sharded


def paged_decode_attention(q_rows, k_cache, v_cache, layer, block_tables, start_pos, sliding_window):
    """Rows of one query token each. q_rows [R, H, D]; k_cache/v_cache [L, N, block_size, K, D] (whole:
    a layer slice would be a copy); layer: scalar; block_tables [R, B]; start_pos [R]. Returns [R, H, D]."""
    _register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_rows.shape, jnp.float32))
    return call(
        q_rows.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        block_tables.astype(jnp.int32),
        start_pos.astype(jnp.int32),
        jnp.int32(sliding_window or 0),
    )
