"""The CPU decode-attention kernel itself: numba code behind an XLA FFI handler (``cpu_decode_attention``
is the JAX side). Imported only when a CPU stage first traces a decode step, so that neither numba nor
LLVM is loaded anywhere else, and the compile lands with the step's own compiles, not with the loading.

The handler speaks XLA's typed FFI C ABI directly (``cpu_ffi``): it reads the call frame's buffers, answers
XLA's metadata query, and returns null (success).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from pipejax.runner.cpu import ffi
from pipejax.runner.cpu.attention_tiles import LANES, scores_tile, values_1, values_2, values_4, values_8
from pipejax.runner.cpu.ffi import float32s
from pipejax.runner.cpu.prefetch import LINE, prefetch
from pipejax.runner.cpu.vector_exp import softmax_numerators

_ARGS = 7  # q, k_cache, v_cache, layer, block_tables, start_pos, sliding_window


# Tasks a parallel call makes at least (where the rows' KV heads allow). A constant, not numba's thread count:
# reading that inside the function would keep numba from caching it.
_MIN_TASKS = 8
# Below this many context slots (rows x padded context) a call stays on the calling thread: waking the pool costs
# more than it saves. In the runner's decode step (12 layers, context 129, 2 CPUs) the kernel took 1.6-1.9 ms on
# one thread against 3.7-4.0 ms spread at 1 row, 3.8-4.1 against 6.7-7.8 at 4, 5.3-8.2 against 5.9-6.2 at 8,
# 12.5-13.1 against 9.4-9.6 at 16 (profiler, 2026-12-01).
_MIN_PARALLEL_SLOTS = 1024
_MAX_WORKERS = 64  # tasks at most a parallel call spreads (each with its scratch); more rows share them in turn


@numba.njit(inline="always")
def _values(p_addr, v_addr, stride, slots, out_addr, chunks):
    """The values tiles (``attention_tiles.values_8``, ...) over ``chunks`` vectors of the head dimension: the widest
    while it fits, then each narrower one at most once."""
    c, step = 0, LANES * 4
    while chunks - c >= 8:
        values_8(p_addr, v_addr + c * step, stride, slots, out_addr + c * step)
        c += 8
    if chunks - c >= 4:
        values_4(p_addr, v_addr + c * step, stride, slots, out_addr + c * step)
        c += 4
    if chunks - c >= 2:
        values_2(p_addr, v_addr + c * step, stride, slots, out_addr + c * step)
        c += 2
    if chunks - c >= 1:
        values_1(p_addr, v_addr + c * step, stride, slots, out_addr + c * step)


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def _attend_row(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out, r, kh_lo, kh_hi, scores, qs,
                acc, totals):
    """Row ``r``'s query heads of KV heads [kh_lo, kh_hi): q [R, H, D], or a layer's qkv [R, K (G + 2), D] whose first
    G heads of each KV head's group are its query heads; k_flat/v_flat: caches
    [L, N, block_size, K, D] (``cache_shape``) flattened; tables [R, B]; start_pos [R] -> out[r, heads].
    Walks the row's blocks in order, so that its K and V are each read as one forward stream: 2.6x faster on one
    core than a pass per KV head, which strides through the blocks (12 layers x 64 rows x 129 slots: 22 against
    58 ms; a one-off probe, 2026-12-01). Within a block, each query head takes its KV head's slots in register tiles
    (``attention_tiles``), the head dimension's remainder past whole vectors in plain loops. scores
    [H, B * block_size + LANES] (a block's last tile writes whole vectors), qs and acc [H, D], totals [H]: scratch."""
    H, D = out.shape[1], out.shape[2]
    blocks, block_size, K = cache_shape[1], cache_shape[2], cache_shape[3]
    G = H // K
    skip = 0 if q.shape[1] == H else 2  # heads past a group's queries in q (a qkv's key and value)
    context, width = tables.shape[1] * block_size, scores.shape[1]
    scale = np.float32(1.0 / math.sqrt(D))
    slot_stride = K * D
    block_stride, layer_base = block_size * slot_stride, layer * blocks * block_size * slot_stride
    h_lo, h_hi = kh_lo * G, kh_hi * G
    hi = min(start_pos[r] + 1, context)  # a decode row sees its own position and what precedes it
    lo = max(0, start_pos[r] - window + 1) if window > 0 else 0
    for h in range(h_lo, h_hi):
        for d in range(D):
            qs[h, d] = q[r, h + h // G * skip, d] * scale
    chunks = D // LANES
    b_last = (hi - 1) // block_size
    k_addr, v_addr, slot_bytes, head_bytes = k_flat.ctypes.data, v_flat.ctypes.data, slot_stride * 4, D * 4
    qs_addr, acc_addr, scores_addr = qs.ctypes.data, acc.ctypes.data, scores.ctypes.data
    heads_lo, heads_bytes = kh_lo * head_bytes, (kh_hi - kh_lo) * head_bytes
    for b in range(lo // block_size, b_last + 1):
        here = (layer_base + tables[r, b] * block_stride) * 4  # the block's byte offset in either cache
        first, end = b * block_size, (b + 1) * block_size
        # the hardware prefetcher cannot guess the row's next block: while this block's scores are taken, the next
        # block's keys and this block's values (read by the second pass) are fetched, a line of each at a time spread
        # evenly over the block's tiles. 12 layers x 64 rows x 129 slots, each layer's cache from memory, 2 threads:
        # 10.4-11.2 ms against 14.9-15.6 without, 13.1-13.9 with a slot's lines at a time, 12.6 with each tile's
        # share in one tight loop (throwaway variants of benchmarks/probes/decode_attention_kernel.py, alternated;
        # AMD EPYC Zen 2 with AVX2 only, 2026-12-07)
        k_next = k_addr + (layer_base + tables[r, min(b + 1, b_last)] * block_stride) * 4 + heads_lo
        v_here = v_addr + here + heads_lo
        c_lo, c_hi = max(lo, first), min(hi, end)
        per_slot = heads_bytes // LINE
        share = -(-(c_hi - c_lo) * per_slot // ((kh_hi - kh_lo) * G * -(-block_size // LANES)))  # lines per tile
        at, line = (c_lo - first) * slot_bytes, 0  # the next line to fetch: its slot's offset, its place there
        for kh in range(kh_lo, kh_hi):
            key = k_addr + here + kh * head_bytes
            for h in range(kh * G, (kh + 1) * G):
                for c0 in range(first, end, LANES):
                    for _ in range(share):
                        if at < (c_hi - first) * slot_bytes:  # a line of each
                            prefetch(k_next + at + line)
                            prefetch(v_here + at + line)
                            line += LINE
                            if line == per_slot * LINE:
                                at, line = at + slot_bytes, 0
                    if c0 + LANES > lo and c0 < hi:
                        # slots past the row's last repeat it (their lanes are ignored): a block's tail is not read
                        scores_tile(qs_addr + h * head_bytes, key + (c0 - first) * slot_bytes, slot_bytes, chunks,
                                    min(LANES, hi - c0), scores_addr + (h * width + c0) * 4)
                for d in range(chunks * LANES, D):  # the head dimension past whole vectors
                    for c in range(c_lo, c_hi):
                        scores[h, c] += qs[h, d] * float32s(key + (c - first) * slot_bytes, D)[d]
    for h in range(h_lo, h_hi):
        totals[h] = softmax_numerators(scores[h], lo, hi)
        for d in range(D):
            acc[h, d] = 0.0
    for b in range(lo // block_size, b_last + 1):
        here = (layer_base + tables[r, b] * block_stride) * 4
        first = max(lo, b * block_size)
        slots = min(hi, (b + 1) * block_size) - first
        for kh in range(kh_lo, kh_hi):
            value = v_addr + here + (first - b * block_size) * slot_bytes + kh * head_bytes
            for h in range(kh * G, (kh + 1) * G):
                p_addr = scores_addr + (h * width + first) * 4
                _values(p_addr, value, slot_bytes, slots, acc_addr + h * head_bytes, chunks)
                for d in range(chunks * LANES, D):
                    for n in range(slots):
                        acc[h, d] += scores[h, first + n] * float32s(value + n * slot_bytes, D)[d]
    for h in range(h_lo, h_hi):
        inv = np.float32(1.0) / totals[h]
        for d in range(D):
            out[r, h, d] = acc[h, d] * inv


@numba.njit(fastmath=True, error_model="numpy")
def _attend_tasks(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out, first, last, splits):
    """Tasks [first, last) in turn, task t being row t // splits's part t % splits of its KV heads. A function of
    its own, not inlined: ``_attend_row`` reads its scratch through pointers, which numba's parallel passes cannot
    see (inlined into the parallel loop, numba hoisted the scratch out of it, as its parallel diagnostics say, and
    the results came out wrong)."""
    H, D, K = out.shape[1], out.shape[2], cache_shape[3]
    scores = np.empty((H, tables.shape[1] * cache_shape[2] + LANES), np.float32)
    qs, acc, totals = np.empty((H, D), np.float32), np.empty((H, D), np.float32), np.empty(H, np.float32)
    for task in range(first, last):
        r, part = task // splits, task % splits
        _attend_row(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out, r, part * K // splits,
                    (part + 1) * K // splits, scores, qs, acc, totals)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _attend(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out):
    """Every row in turn, on the calling thread."""
    _attend_tasks(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out, 0, q.shape[0], 1)


@numba.njit(fastmath=True, error_model="numpy", cache=True, parallel=True)
def _attend_parallel(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out):
    """The rows spread over numba's threads (TBB: safe for concurrent callers) in up to ``_MAX_WORKERS`` tasks;
    with fewer than ``_MIN_TASKS`` rows, each row's KV heads are split between tasks too, so that a single long row
    is not left to one thread. Calls with fewer than ``_MIN_PARALLEL_SLOTS`` context slots run on the calling
    thread."""
    R = q.shape[0]
    K = cache_shape[3]
    if R * tables.shape[1] * cache_shape[2] < _MIN_PARALLEL_SLOTS:
        _attend(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out)
        return
    splits = min(K, -(-_MIN_TASKS // R))
    tasks = R * splits
    workers = min(tasks, _MAX_WORKERS)
    for w in numba.prange(workers):
        _attend_tasks(q, k_flat, v_flat, cache_shape, layer, tables, start_pos, window, out, w * tasks // workers,
                      (w + 1) * tasks // workers, splits)


@numba.njit(inline="always")
def _operands(frame):
    """The call's buffers as the arguments of ``_attend``."""
    args, rets = ffi.arguments(frame, _ARGS)
    start_pos, window = ffi.vector_i32(args, 5), ffi.scalar_i32(args, 6)
    return ffi.paged_attention_operands(args) + (start_pos, window, ffi.array3_f32(rets, 0))


def _handler(frame_addr):  # compiled by compile_handler
    return ffi.serve(frame_addr, _operands, _attend)


def _handler_parallel(frame_addr):  # the same over numba's threads
    return ffi.serve(frame_addr, _operands, _attend_parallel)


compile_handler = ffi.handler_compiler(_handler, _handler_parallel)
