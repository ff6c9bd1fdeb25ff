"""The CPU prefill-attention kernel itself: numba code behind an XLA FFI handler (``cpu_prefill_attention`` is the
JAX side). Imported only when a CPU stage first traces a prefill step, like the other CPU kernels.

One task per (row, KV head), spread over numba's threads: the task copies its queries (every query head of the
KV head, scaled) and the row's keys and values, read once from the paged cache through the block table, into
scratch laid out for the dense kernel's register-tiled microkernel (``cpu_dense_kernel``): keys as panels of 32
context slots [D, 32], values as panels of 32 head-dim columns [C, 32]. Scores and the weighted values are then
tiles of query rows (``QUERY_TILE``) against those panels, each tile only as far into the context as its last query
can see (a causal prefill skips about half of the square), with the softmax between them.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from pipejax.runner.cpu import ffi
from pipejax.runner.cpu.dense_kernel import PANEL, ROW_TILES, rows_times_panel
from pipejax.runner.cpu.vector_exp import softmax_numerators

# query rows per tile: the dense kernel's tallest tile (6 with AVX2: a prefill layer's attention over 16 prompts of 128
# took 5.97 ms against 6.42 in tiles of 8, each 6 + 2 rows; AMD EPYC Zen 2, 2026-12-07)
QUERY_TILE = ROW_TILES[0]
_ARGS = 8  # q, k_cache, v_cache, layer, block_tables, query_start, start_pos, sliding_window


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def _attend(q, k_flat, v_flat, cache_shape, layer, tables, query_start, start_pos, window, out, r, kh):
    """Row ``r``'s query heads of KV head ``kh``: q [T, H, D]; k_flat/v_flat: caches [L, N, block_size, K, D]
    (``cache_shape``) flattened; tables [R, B]; query_start/start_pos [R] (of query slot 0: a row is
    right-aligned, so both may be negative) -> out [R, Q, H, D]."""
    T, H, D = q.shape
    _, Q, _, _ = out.shape
    blocks, block_size, K = cache_shape[1], cache_shape[2], cache_shape[3]
    G = H // K
    rows = Q * G  # query row j is slot j // G, head kh * G + j % G
    context = min(tables.shape[1] * block_size, max(start_pos[r] + Q, 1))  # what the row's last slot can see
    width = -(-context // PANEL) * PANEL
    slot_stride = K * D
    block_stride, layer_base = block_size * slot_stride, layer * blocks * block_size * slot_stride
    scale = np.float32(1.0 / math.sqrt(D))

    qs = np.empty((rows, D), np.float32)
    for j in range(rows):
        t = min(max(query_start[r] + j // G, 0), T - 1)
        h = kh * G + j % G
        for d in range(D):
            qs[j, d] = q[t, h, d] * scale
    keys = np.empty((width // PANEL, D, PANEL), np.float32)  # keys[p, d, i]: slot p * 32 + i
    values = np.empty((D // PANEL, width, PANEL), np.float32)  # values[p, c, i]: column p * 32 + i (c < context)
    staged = np.zeros((PANEL, D), np.float32)  # one panel's keys as the cache holds them, then transposed
    for c in range(context):
        base = layer_base + tables[r, c // block_size] * block_stride + (c % block_size) * slot_stride + kh * D
        k_slot, v_slot = k_flat[base:base + D], v_flat[base:base + D]  # (slices: see cpu_vector_exp)
        staged[c % PANEL, :] = k_slot
        for p in range(D // PANEL):
            values[p, c, :] = v_slot[p * PANEL:(p + 1) * PANEL]
        if c % PANEL == PANEL - 1 or c == context - 1:
            if c == context - 1:
                staged[c % PANEL + 1:, :] = 0.0
            panel = keys[c // PANEL]
            for d in range(D):
                panel[d, :] = staged[:, d]

    scores = np.empty((rows, width), np.float32)
    acc = np.empty((rows, D), np.float32)
    totals = np.empty(QUERY_TILE, np.float32)
    for j0 in range(0, rows, QUERY_TILE):
        m = min(QUERY_TILE, rows - j0)
        seen = min(max(start_pos[r] + (j0 + m - 1) // G, 0) + 1, context)  # slots the tile's last row sees
        for p in range(-(-seen // PANEL)):
            rows_times_panel(qs.ctypes.data + j0 * D * 4, D, keys.ctypes.data + p * D * PANEL * 4,
                             scores.ctypes.data + (j0 * width + p * PANEL) * 4, width, m, D, 0)
        for j in range(j0, j0 + m):  # softmax over the slots row j sees; zero for the rest of the tile's
            pos = max(start_pos[r] + j // G, 0)
            hi = min(pos + 1, context)
            lo = min(max(0, pos - window + 1), hi - 1) if window > 0 else 0
            totals[j - j0] = softmax_numerators(scores[j], lo, hi)
            for c in range(lo):
                scores[j, c] = 0.0
            for c in range(hi, seen):
                scores[j, c] = 0.0
        for p in range(D // PANEL):
            rows_times_panel(scores.ctypes.data + j0 * width * 4, width, values.ctypes.data + p * width * PANEL * 4,
                             acc.ctypes.data + (j0 * D + p * PANEL) * 4, D, m, seen, 0)
        for j in range(j0, j0 + m):
            t, h = j // G, kh * G + j % G
            inv = np.float32(1.0) / totals[j - j0]
            for d in range(D):
                out[r, t, h, d] = acc[j, d] * inv


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _attend_all(q, k_flat, v_flat, cache_shape, layer, tables, query_start, start_pos, window, out):
    """Every (row, KV head) in turn, on the calling thread."""
    for task in range(out.shape[0] * cache_shape[3]):
        _attend(q, k_flat, v_flat, cache_shape, layer, tables, query_start, start_pos, window, out,
                task // cache_shape[3], task % cache_shape[3])


@numba.njit(fastmath=True, error_model="numpy", cache=True, parallel=True)
def _attend_parallel(q, k_flat, v_flat, cache_shape, layer, tables, query_start, start_pos, window, out):
    """The (row, KV head) tasks spread over numba's threads (TBB)."""
    for task in numba.prange(out.shape[0] * cache_shape[3]):
        _attend(q, k_flat, v_flat, cache_shape, layer, tables, query_start, start_pos, window, out,
                task // cache_shape[3], task % cache_shape[3])


@numba.njit(inline="always")
def _operands(frame):
    """The call's buffers as the arguments of ``_attend_all``."""
    args, rets = ffi.arguments(frame, _ARGS)
    starts = (ffi.vector_i32(args, 5), ffi.vector_i32(args, 6))  # query_start, start_pos
    return ffi.paged_attention_operands(args) + starts + (ffi.scalar_i32(args, 7), ffi.array4_f32(rets, 0))


def _handler(frame_addr):  # compiled by compile_handler
    return ffi.serve(frame_addr, _operands, _attend_all)


def _handler_parallel(frame_addr):  # the same over numba's threads
    return ffi.serve(frame_addr, _operands, _attend_parallel)


compile_handler = ffi.handler_compiler(_handler, _handler_parallel)
