"""The CPU dense-matmul kernel itself: numba code behind an XLA FFI handler (``cpu_dense`` is the JAX side).
Imported only when a CPU stage first traces a step over weights in panels, like ``cpu_decode_kernel``.

``x [M, Kc] @ w -> [M, N]`` for a weight stored in panels (``panels.Panels``: [N / 32, Kc, 32], each panel's
32 output columns contiguous for every input row). The weight streams from memory in order, one panel at a
time, the next one prefetched into L2 while this one is multiplied; each panel is read from L1/L2 by every tile
of rows, whose outputs stay in registers over the whole contraction (the microkernel below is LLVM IR: numba's
own loops would keep them in memory). The tile is two vector registers wide, sized by the target's
(``isa.vector_lanes``): 12 rows x 2 zmm with AVX-512 (24 of its 32 registers, a whole panel's width), 6 rows x 2
ymm with AVX2 (12 of its 16; each panel in two column groups of 16). XLA:CPU's dot reads a row-major [Kc, N]
weight in short strided runs instead.
Whether the kernel wins on a given CPU is measured at start-up (``select``).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pipejax.runner.cpu import amx_kernel, ffi, isa, prefetch
from pipejax.runner.cpu.dense import ADD, AMX, GATED, NORMED, ROTARY, ROUTED, SPLIT, TILED
from pipejax.runner.cpu.ffi import address, arguments, buffer, float32s, handler_compiler, ptr, scalar_i32, serve
from pipejax.runner.cpu.ir_loop import CountedLoop, fma, splat
from pipejax.runner.cpu.vector_exp import exp_f32
from pipejax.runner.panels import PANEL

LANES = isa.vector_lanes()  # float32 lanes of the target's vector registers
VECTORS = 2  # registers per row of a tile
GROUPS = PANEL // (VECTORS * LANES)  # column groups a panel is multiplied in: 1 with AVX-512, 2 with AVX2
# rows per microkernel call, tallest first: the smaller ones (each taken at most once) cover any remainder. With
# AVX-512, 12 rows x 2 zmm keep 24 of the 32 registers accumulating: 291-297 against 266-272 GFLOP/s for 8 rows
# (64 x 768 x 4096 on one weight again and again, benchmarks/probes/dense_kernel_stream.py; measured only on an
# Intel Xeon, 2026-12-06). With AVX2, 6 rows x 2 ymm (one 64-byte line of a panel row a step, 12 FMAs): 99-111
# against 72 GFLOP/s for the whole panel's width in 3 rows x 4 ymm, 101-104 for 4 rows, 85 for 8 x 1 ymm (the same
# shape, a throwaway probe; AMD EPYC with AVX2 only, 2026-12-07). Whether the kernel beats XLA's dot on a given CPU
# is still measured by ``select``.
ROW_TILES = (12, 8, 4, 2, 1) if GROUPS == 1 else (6, 4, 2, 1)
# With AVX2 the dense calls first copy x's rows, a tallest tile's at a time, into one stream [kc, 6] (``_pack``):
# each step's 6 broadcasts then read one line a little under every third step, not 6 rows' lines. 512 and 2048 rows
# x 768 x 4096, the least of 20 alternated rounds, the copy included: 134 against 116 and 114 GFLOP/s unpacked, XLA's
# dot 115 and 114 (64 rows: 124, 121, 106; a throwaway probe, AMD EPYC with AVX2 only, 2026-12-07). Not measured
# with AVX-512: there x's rows are read as they are.
PACKED = GROUPS == 2
# A dense call whose x is larger than X_BLOCK bytes (half the last-level cache, at most 32 MiB) takes x's rows in
# equal blocks under it, every panel over one block before the next, so that the block stays in that cache while
# the panels stream past it. Down at 2048 prefill rows (x [2048, 2048], 16 MiB: the whole L3 of an AMD EPYC Zen 2
# with AVX2 only, 2026-12-07): 43.3-45.1 ms (143-149 GFLOP/s) in one pass, 36.0-36.3 in three blocks of 684 rows;
# 1536 rows 29.7 against 27.2-27.3; calls whose x fits (512 x 2048, 2048 x 768) alike either way (least of 7, 6
# weights in turn; a throwaway probe over _matmul_parallel).
X_BLOCK = min(isa.last_level_cache_bytes() // 2, 32 << 20)


def _microkernel(rows: int, add: bool, packed: bool = False):
    """An intrinsic ``(x, ldx, w, out, ldo, kc, ahead, ahead_rows)`` (addresses, strides in floats): ``out[r, :n]
    = sum_k x[r, k] * w[k, :n]`` for ``rows`` rows, n = ``VECTORS * LANES`` columns; ``w`` points into one panel
    [kc, 32] (rows 32 floats apart) at its column group's first column. ``packed``: x is the rows packed [kc, rows]
    (``_pack``; ``ldx`` unused). ``add``: ``out[r, :n] +=``
    instead, the sum added to what ``out`` holds once it is complete (the same rounding as XLA's add after the dot).
    Its first ``ahead_rows`` steps also prefetch one panel row (128 bytes) each from ``ahead`` on into L2: the next
    panel's share of this tile (``_part``), so that the weight's stream from memory runs under the arithmetic."""

    @intrinsic
    def kernel(typingctx, x, ldx, w, out, ldo, kc, ahead, ahead_rows):
        sig = types.void(*[types.int64] * 8)

        def codegen(context, builder, signature, args):
            x_addr, ldx, w_addr, out_addr, ldo, kc, ahead, ahead_rows = args
            i64, f32 = ir.IntType(64), ir.FloatType()
            vec, fma_v = ir.VectorType(f32, LANES), fma(builder, LANES)
            x0, w0, out0 = (builder.inttoptr(a, f32.as_pointer()) for a in (x_addr, w_addr, out_addr))
            # one input row k a trip: 2 weight registers, `rows` broadcasts, 2 FMAs each
            loop = CountedLoop(builder, kc, "panel", [ir.Constant(vec, [0.0] * LANES)] * (VECTORS * rows))
            k, acc = loop.index, loop.carried
            fetch, latch = (builder.function.append_basic_block(f"panel.{n}") for n in ("ahead", "latch"))
            w_row = builder.gep(w0, [builder.mul(k, ir.Constant(i64, PANEL))])
            halves = [builder.load(builder.bitcast(builder.gep(w_row, [ir.Constant(i64, LANES * h)]),
                                                   vec.as_pointer()), align=4) for h in range(VECTORS)]
            new = []
            for r in range(rows):
                at = (builder.add(builder.mul(k, ir.Constant(i64, rows)), ir.Constant(i64, r)) if packed
                      else builder.add(builder.mul(ir.Constant(i64, r), ldx), k))
                xv = splat(builder, builder.load(builder.gep(x0, [at])), LANES)
                new += [builder.call(fma_v, [xv, halves[h], acc[VECTORS * r + h]]) for h in range(VECTORS)]
            builder.cbranch(builder.icmp_signed("<", k, ahead_rows), fetch, latch)
            builder.position_at_end(fetch)
            row = builder.add(ahead, builder.mul(k, ir.Constant(i64, PANEL * 4)))
            for line in range(0, PANEL * 4, prefetch.LINE):
                prefetch.emit(builder, builder.add(row, ir.Constant(i64, line)))
            builder.branch(latch)
            builder.position_at_end(latch)
            sums = loop.close(new)
            for r in range(rows):
                for h in range(VECTORS):
                    at = builder.add(builder.mul(ir.Constant(i64, r), ldo), ir.Constant(i64, LANES * h))
                    dest = builder.bitcast(builder.gep(out0, [at]), vec.as_pointer())
                    total = sums[VECTORS * r + h]
                    total = builder.fadd(builder.load(dest, align=4), total) if add else total
                    builder.store(total, dest, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return kernel


@numba.njit(inline="always")
def _part(ahead, share, t, kc):
    """Tile ``t``'s part of the next panel's prefetch: its first row's address and how many rows (``share`` each)."""
    return ahead + t * share * PANEL * 4, max(min(share, kc - t * share), 0)


def _row_tiles(add: bool):
    """``rows_times_panel`` (``add``: ``rows_plus_panel``) over the microkernels of every tile height in
    ``ROW_TILES``: the tallest while it fits, then each smaller one at most once. Where ``PACKED``, a call given
    x's rows packed (``_pack``; ``xp_addr`` not 0) reads its tallest tiles from there."""
    top, *rest = ROW_TILES
    rest += [0] * (4 - len(rest))  # a height of 0 is never taken (a constant: LLVM drops its branch)
    kernels = [_microkernel(r, add) for r in ROW_TILES]
    kernels += [kernels[-1]] * (5 - len(kernels))
    k_top, k_a, k_b, k_c, k_d = kernels
    k_packed = _microkernel(top, add, packed=True) if PACKED else k_top
    r_a, r_b, r_c, r_d = rest

    @numba.njit(inline="always")
    def group(x_addr, ldx, w_addr, out_addr, ldo, m, kc, ahead, share, t, xp_addr):
        """One column group's tiles; tile ``t`` on is each call's number in the panel (for its prefetch share)."""
        i = 0
        while i + top <= m:
            out_i, part = out_addr + i * ldo * 4, _part(ahead, share, t, kc)
            if PACKED and xp_addr:
                k_packed(xp_addr + i * ldx * 4, ldx, w_addr, out_i, ldo, kc, *part)
            else:
                k_top(x_addr + i * ldx * 4, ldx, w_addr, out_i, ldo, kc, *part)
            i, t = i + top, t + 1
        if r_a and i + r_a <= m:
            k_a(x_addr + i * ldx * 4, ldx, w_addr, out_addr + i * ldo * 4, ldo, kc, *_part(ahead, share, t, kc))
            i, t = i + r_a, t + 1
        if r_b and i + r_b <= m:
            k_b(x_addr + i * ldx * 4, ldx, w_addr, out_addr + i * ldo * 4, ldo, kc, *_part(ahead, share, t, kc))
            i, t = i + r_b, t + 1
        if r_c and i + r_c <= m:
            k_c(x_addr + i * ldx * 4, ldx, w_addr, out_addr + i * ldo * 4, ldo, kc, *_part(ahead, share, t, kc))
            i, t = i + r_c, t + 1
        if r_d and i + r_d <= m:
            k_d(x_addr + i * ldx * 4, ldx, w_addr, out_addr + i * ldo * 4, ldo, kc, *_part(ahead, share, t, kc))
            t += 1
        return t

    @numba.njit(inline="always")
    def tiles(x_addr, ldx, w_addr, out_addr, ldo, m, kc, ahead, xp_addr=0):
        calls, rest = m // top, m % top  # the tiles this panel takes: each prefetches its share of ``ahead``
        for r in (r_a, r_b, r_c, r_d):
            if r and rest >= r:
                calls, rest = calls + 1, rest - r
        share = -(-kc // max(calls * GROUPS, 1)) if ahead else 0
        t = 0
        for g in range(GROUPS):
            columns = g * VECTORS * LANES * 4
            t = group(x_addr, ldx, w_addr + columns, out_addr + columns, ldo, m, kc, ahead, share, t, xp_addr)

    return tiles


# ``out[r, :32] = x[r, :kc] @ w`` for ``m`` rows (strides ``ldx``, ``ldo`` in floats) and one panel ``w`` [kc, 32]:
# tiles of ``ROW_TILES`` rows, in each of the panel's ``GROUPS`` column groups in turn. ``rows_plus_panel``:
# ``out[r, :32] += x[r, :kc] @ w``. ``ahead`` is the address of the panel to come (prefetched into L2 while this one
# is multiplied), or 0 for none; an optional last argument, the address of x's rows packed (``_pack``), or 0.
rows_times_panel, rows_plus_panel = _row_tiles(False), _row_tiles(True)


@numba.njit(inline="always")
def _pack_tile(x_addr, kc, xp_addr, t):
    """Rows [t * top, (t + 1) * top) of x [m, kc] -> xp[t] [kc, top] (top: ``ROW_TILES[0]``)."""
    top = ROW_TILES[0]
    dest = float32s(xp_addr + t * kc * top * 4, kc * top)
    for r in range(top):
        row = float32s(x_addr + (t * top + r) * kc * 4, kc)
        for k in range(kc):
            dest[k * top + r] = row[k]


@numba.njit(inline="always")
def _packed_rows(m, kc):
    """x's packed rows (``PACKED``: each whole tallest tile's [kc, top]; else none)."""
    return np.empty((m // ROW_TILES[0]) * kc * ROW_TILES[0] if PACKED else 0, np.float32)


@numba.njit
def _pack(x_addr, m, kc):
    """x [m, kc]'s whole tallest tiles packed (``_packed_rows``), on the calling thread."""
    xp, top = _packed_rows(m, kc), ROW_TILES[0]
    for t in range(xp.size // max(kc * top, 1)):
        _pack_tile(x_addr, kc, xp.ctypes.data, t)
    return xp


@numba.njit(parallel=True)
def _pack_parallel(x_addr, m, kc):
    """The same with the tiles spread over numba's threads."""
    xp, top = _packed_rows(m, kc), ROW_TILES[0]
    tiles, xp_addr = xp.size // max(kc * top, 1), xp.ctypes.data
    for t in numba.prange(tiles):
        _pack_tile(x_addr, kc, xp_addr, t)
    return xp


@numba.njit(inline="always")
def _panel_into(x_addr, w_addr, out_addr, m, kc, panels, p, add, xp):
    """One panel's product; ``xp``: x's rows packed (``_pack``), or empty."""
    n, panel = panels * PANEL, kc * PANEL * 4
    w_p, out_p = w_addr + p * panel, out_addr + p * PANEL * 4
    ahead = w_p + panel if p + 1 < panels else 0
    xp_addr = xp.ctypes.data if xp.size else 0
    if add:
        rows_plus_panel(x_addr, kc, w_p, out_p, n, m, kc, ahead, xp_addr)
    else:
        rows_times_panel(x_addr, kc, w_p, out_p, n, m, kc, ahead, xp_addr)


@numba.njit(inline="always")
def _block_rows(m, kc):
    """Rows per block of x [m, kc]: as few equal blocks as keep each within ``X_BLOCK``, in whole tallest tiles."""
    top = ROW_TILES[0]
    most = max(top, X_BLOCK // (kc * 4) // top * top)
    rows = -(-m // -(-m // most))  # m over the fewest blocks of at most ``most`` rows
    return -(-rows // top) * top


@numba.njit(cache=True)
def _matmul(x_addr, w_addr, out_addr, m, kc, panels, add):
    """out [m, panels * 32] = x [m, kc] @ w [panels, kc, 32] (``add``: +=), on the calling thread, x's rows in
    blocks (``X_BLOCK``)."""
    xp, n, block = _pack(x_addr, m, kc), panels * PANEL, _block_rows(m, kc)
    for b0 in range(0, m, block):
        rows = min(block, m - b0)
        for p in range(panels):
            _panel_into(x_addr + b0 * kc * 4, w_addr, out_addr + b0 * n * 4, rows, kc, panels, p, add, xp[b0 * kc:])


@numba.njit(cache=True, parallel=True)
def _matmul_parallel(x_addr, w_addr, out_addr, m, kc, panels, add):
    """The same with each block's panels spread over numba's threads (TBB)."""
    xp, n, block = _pack_parallel(x_addr, m, kc), panels * PANEL, _block_rows(m, kc)
    for b0 in range(0, m, block):  # (a parallel loop over the panels for each block in turn)
        rows, xp_b = min(block, m - b0), xp[b0 * kc:]
        for p in numba.prange(panels):
            _panel_into(x_addr + b0 * kc * 4, w_addr, out_addr + b0 * n * 4, rows, kc, panels, p, add, xp_b)


# rows per block of the gated matmul: a block's gate and up tiles (15-16 KB each) stay in L1/L2 (whole tallest tiles
# where x's rows are packed)
GLU_ROWS = 120 if PACKED else 128


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def _glu_panel(x_addr, kc, w_addr, out_addr, p, panels, m, gate, up, xp):
    """out[:, p * 32:][:32] = silu(x @ panel p) * (x @ panel p + panels / 2) (gate, then up) in blocks of GLU_ROWS
    rows; out [m, panels / 2 * 32]; ``gate``/``up`` [GLU_ROWS, 32] scratch; ``xp``: x's rows packed, or empty."""
    panel, half = kc * PANEL * 4, panels // 2
    out = numba.carray(ptr(out_addr), (m, half * PANEL), np.float32)
    for b0 in range(0, m, GLU_ROWS):
        rows = min(GLU_ROWS, m - b0)
        ahead = b0 + GLU_ROWS >= m and p + 1 < half  # the next pair's panels, over this pair's last block
        x_b, w_gate, w_up = x_addr + b0 * kc * 4, w_addr + p * panel, w_addr + (p + half) * panel
        ahead_gate, ahead_up = (w_gate + panel, w_up + panel) if ahead else (0, 0)
        xp_b = xp.ctypes.data + b0 * kc * 4 if xp.size else 0
        rows_times_panel(x_b, kc, w_gate, gate.ctypes.data, PANEL, rows, kc, ahead_gate, xp_b)
        rows_times_panel(x_b, kc, w_up, up.ctypes.data, PANEL, rows, kc, ahead_up, xp_b)
        for i in range(rows):
            o, g, u = out[b0 + i, p * PANEL:(p + 1) * PANEL], gate[i], up[i]
            for c in range(PANEL):
                o[c] = g[c] / (np.float32(1.0) + exp_f32(-g[c])) * u[c]


@numba.njit(inline="always")
def _glu_scratch():
    return np.empty((GLU_ROWS, PANEL), np.float32), np.empty((GLU_ROWS, PANEL), np.float32)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _glu(x_addr, w_addr, out_addr, m, kc, panels):
    """out [m, panels / 2 * 32] = silu(x @ gate) * (x @ up) for w [panels, kc, 32]: gate's panels, then up's; on
    the calling thread."""
    gate, up = _glu_scratch()
    xp = _pack(x_addr, m, kc)
    for p in range(panels // 2):
        _glu_panel(x_addr, kc, w_addr, out_addr, p, panels, m, gate, up, xp)


@numba.njit(fastmath=True, error_model="numpy", cache=True, parallel=True)
def _glu_parallel(x_addr, w_addr, out_addr, m, kc, panels):
    """The same with the panel pairs spread over numba's threads (TBB)."""
    xp = _pack_parallel(x_addr, m, kc)
    for p in numba.prange(panels // 2):
        gate, up = _glu_scratch()
        _glu_panel(x_addr, kc, w_addr, out_addr, p, panels, m, gate, up, xp)


# --- x RMS-normed as a call reads it (``NORMED``): a decoder layer's qkv and gate_up, the LM head ---------------------
# In XLA the norm's reduction ran as a fusion of its own on XLA's thread pool, handed to and back from numba's threads
# around every dense call: 35-146 us a norm at a decode step's 64 rows x 768 (a profile of 196 KB of work; AMD EPYC
# Zen 4 with AVX-512, 2026-12-07). Here it is a pass over x on the calling thread before the matmul reads it.
# Rows x contraction from which the norm (and the rotary) is spread over numba's threads: set between a decode step's
# 64 x 768 and a prefill's 2048 x 768, not tuned.
NORM_PARALLEL_FLOATS = 1 << 18


@numba.njit(fastmath={"reassoc", "contract", "nsz"}, error_model="numpy", inline="always")
def _norm_row(x_addr, w_addr, eps, out_addr, kc, r):
    """Row ``r`` of x [m, kc] RMS-normed into out (``model.rms_norm``: x * rsqrt(mean(x^2) + eps), times the weight)."""
    x, w, out = float32s(x_addr + r * kc * 4, kc), float32s(w_addr, kc), float32s(out_addr + r * kc * 4, kc)
    total = np.float32(0.0)
    for k in range(kc):
        total += x[k] * x[k]
    inv = np.float32(1.0) / np.sqrt(total / np.float32(kc) + eps)
    for k in range(kc):
        out[k] = w[k] * (x[k] * inv)


@numba.njit
def _normed(x_addr, w_addr, eps, m, kc):
    """x [m, kc] RMS-normed with weight [kc] (``_norm_row``), a new array [m * kc] (at least one float: ``_call``
    writes one after the matmul), on the calling thread."""
    out = np.empty(max(m * kc, 1), np.float32)
    for r in range(m):
        _norm_row(x_addr, w_addr, eps, out.ctypes.data, kc, r)
    return out


@numba.njit(parallel=True)
def _normed_parallel(x_addr, w_addr, eps, m, kc):
    """The same with the rows spread over numba's threads where there are ``NORM_PARALLEL_FLOATS`` or more."""
    if m * kc < NORM_PARALLEL_FLOATS:
        return _normed(x_addr, w_addr, eps, m, kc)
    out = np.empty(max(m * kc, 1), np.float32)
    out_addr = out.ctypes.data
    for r in numba.prange(m):
        _norm_row(x_addr, w_addr, eps, out_addr, kc, r)
    return out


@numba.njit(fastmath={"reassoc", "contract", "nsz"}, error_model="numpy", inline="always")
def _rotate_row(out_addr, n, cos_addr, sin_addr, d, group, rotated, r):
    """Row ``r`` of out [m, n] (heads of ``d`` in groups of ``group``): the first ``rotated`` heads of each group
    rotated in place by the row's tables cos and signed sin [m, d] (``rope.apply_rope``: x * cos + swapped halves
    of x * sin)."""
    half = d // 2
    cos, sin = float32s(cos_addr + r * d * 4, d), float32s(sin_addr + r * d * 4, d)
    for g in range(n // (group * d)):
        for j in range(rotated):
            x = float32s(out_addr + (r * n + (g * group + j) * d) * 4, d)
            for i in range(half):
                a, b = x[i], x[i + half]
                x[i] = a * cos[i] + b * sin[i]
                x[i + half] = b * cos[i + half] + a * sin[i + half]


@numba.njit
def _rotate(out_addr, m, n, cos_addr, sin_addr, d, group, rotated):
    """``_rotate_row`` over out's rows, on the calling thread."""
    for r in range(m):
        _rotate_row(out_addr, n, cos_addr, sin_addr, d, group, rotated, r)


@numba.njit(parallel=True)
def _rotate_parallel(out_addr, m, n, cos_addr, sin_addr, d, group, rotated):
    """The same with the rows spread over numba's threads where there are ``NORM_PARALLEL_FLOATS`` or more floats."""
    if m * n < NORM_PARALLEL_FLOATS:
        _rotate(out_addr, m, n, cos_addr, sin_addr, d, group, rotated)
        return
    for r in numba.prange(m):
        _rotate_row(out_addr, n, cos_addr, sin_addr, d, group, rotated, r)


# --- a Mixture-of-Experts layer's routed experts (``cpu_dense.routed_experts``) ------------------------------------


@numba.njit(inline="always")
def _routes_by_expert(chosen):
    """The routes (token t's j-th expert: route t k + j) of ``chosen`` [T, k] sorted by expert (stable): each
    expert's first sorted position (``starts`` [n + 1], n the largest expert id + 1) and the sorted routes."""
    T, k = chosen.shape
    n = 0
    for t in range(T):
        for j in range(k):
            n = max(n, chosen[t, j] + 1)
    starts = np.zeros(n + 1, np.int64)
    for t in range(T):
        for j in range(k):
            starts[chosen[t, j] + 1] += 1
    for e in range(n):
        starts[e + 1] += starts[e]
    fill, order = starts[:n].copy(), np.empty(T * k, np.int64)
    for t in range(T):
        for j in range(k):
            e = chosen[t, j]
            order[fill[e]] = t * k + j
            fill[e] += 1
    return starts, order


# (``_routed_setup`` and ``_routed_combine`` are not inlined: inside the parallel handler numba would turn each of
# their row copies and adds into a parallel loop of its own, one TBB launch per row)
@numba.njit
def _routed_setup(x_addr, T, E, chosen):
    """The routes sorted by expert (``_routes_by_expert``), their tokens' rows gathered in that order (xs [T k, E]),
    and the experts that have routes."""
    starts, order = _routes_by_expert(chosen)
    k = chosen.shape[1]
    x = numba.carray(ptr(x_addr), (T, E), np.float32)
    xs = np.empty((order.shape[0], E), np.float32)
    for i in range(order.shape[0]):
        xs[i] = x[order[i] // k]
    n = starts.shape[0] - 1
    active = np.empty(n, np.int64)
    count = 0
    for e in range(n):
        if starts[e + 1] > starts[e]:
            active[count] = e
            count += 1
    return starts, order, xs, active[:count]


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def _routed_gate_up(task, active, starts, xs, act, gu_addr, base, E, gu_panels):
    """Task ``task`` of the gate/up pass: one expert's routes through one pair of its gate and up panels."""
    half = gu_panels // 2
    e, p = active[task // half], task % half
    gate, up = _glu_scratch()
    w_addr = gu_addr + (base + e) * gu_panels * E * PANEL * 4
    _glu_panel(xs.ctypes.data + starts[e] * E * 4, E, w_addr, act.ctypes.data + starts[e] * half * PANEL * 4, p,
               gu_panels, starts[e + 1] - starts[e], gate, up, np.empty(0, np.float32))


@numba.njit(inline="always")
def _routed_down(task, active, starts, act, ys, down_addr, base, E, Fm):
    """Task ``task`` of the down pass: one expert's routes through one of its down panels."""
    panels = E // PANEL
    e, p = active[task // panels], task % panels
    w_addr = down_addr + (base + e) * panels * Fm * PANEL * 4
    _panel_into(act.ctypes.data + starts[e] * Fm * 4, w_addr, ys.ctypes.data + starts[e] * E * 4,
                starts[e + 1] - starts[e], Fm, panels, p, False, np.empty(0, np.float32))


@numba.njit(fastmath=True, error_model="numpy")
def _routed_combine(out_addr, T, E, ys, order, weights):
    """out[t] += sum of t's routes' outputs times their weights, added in expert order (as transformers' loop over
    the experts adds them)."""
    k = weights.shape[1]
    position = np.empty(order.shape[0], np.int64)
    for i in range(order.shape[0]):
        position[order[i]] = i
    out = numba.carray(ptr(out_addr), (T, E), np.float32)
    y = np.empty(E, np.float32)
    for t in range(T):
        y[:] = 0
        for i in np.sort(position[t * k:(t + 1) * k]):
            y += weights[t, order[i] % k] * ys[i]
        out[t] += y


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _routed(x_addr, gu_addr, base, down_addr, chosen, weights, out_addr, T, E, gu_panels, Fm):
    """out [T, E] += the routed experts' MLPs of x, on the calling thread (``cpu_dense.routed_experts``)."""
    starts, order, xs, active = _routed_setup(x_addr, T, E, chosen)
    act, ys = np.empty((order.shape[0], Fm), np.float32), np.empty((order.shape[0], E), np.float32)
    for task in range(active.shape[0] * (gu_panels // 2)):
        _routed_gate_up(task, active, starts, xs, act, gu_addr, base, E, gu_panels)
    for task in range(active.shape[0] * (E // PANEL)):
        _routed_down(task, active, starts, act, ys, down_addr, base, E, Fm)
    _routed_combine(out_addr, T, E, ys, order, weights)


@numba.njit(fastmath=True, error_model="numpy", cache=True, parallel=True)
def _routed_parallel(x_addr, gu_addr, base, down_addr, chosen, weights, out_addr, T, E, gu_panels, Fm):
    """The same with each pass's (expert, panel) tasks spread over numba's threads (TBB)."""
    starts, order, xs, active = _routed_setup(x_addr, T, E, chosen)
    act, ys = np.empty((order.shape[0], Fm), np.float32), np.empty((order.shape[0], E), np.float32)
    for task in numba.prange(active.shape[0] * (gu_panels // 2)):
        _routed_gate_up(task, active, starts, xs, act, gu_addr, base, E, gu_panels)
    for task in numba.prange(active.shape[0] * (E // PANEL)):
        _routed_down(task, active, starts, act, ys, down_addr, base, E, Fm)
    _routed_combine(out_addr, T, E, ys, order, weights)


@numba.njit(inline="always")
def _array2(args, i, dtype):
    data, dims = buffer(args, i)
    return numba.carray(data, (dims[0], dims[1]), dtype)


@numba.njit(inline="always")
def _routed_operands(frame):
    """x [T, E]; the experts' gate/up panels [L X, 2 Fm / 32, E, 32] and the layer's first expert there (an int32
    scalar); the mode; down panels [L X, E / 32, Fm, 32]; chosen [T, k] int32; weights [T, k]; the residual
    [T, E], out's own buffer."""
    args, rets = arguments(frame, 8)
    x_data, x_dims = buffer(args, 0)
    gu_data, gu_dims = buffer(args, 1)
    down_data, down_dims = buffer(args, 4)
    return (address(x_data), address(gu_data), scalar_i32(args, 2), address(down_data), _array2(args, 5, np.int32),
            _array2(args, 6, np.float32), address(buffer(rets, 0)[0]), x_dims[0], x_dims[1], gu_dims[1], down_dims[2])


@numba.njit(inline="always")
def _operands(frame):
    """The call's mode (``cpu_dense.PLAIN``, ``GATED`` or ``ADD``, flags ``AMX``, ``TILED`` and ``NORMED``); x's
    address, layer ``layer``'s panels' address, out's, its tiles' (0 without ``TILED``); rows, contraction and panels;
    the norm's weight's address (0 without ``NORMED``) and eps. x [M, Kc], w [L, P, Kc, PANEL], layer and mode int32
    scalars; with ``TILED`` the next operand, w's tiles [L, P, Kc / 32, 6 x 512] uint16; with ``NORMED`` the next
    two, the norm's weight [Kc] and its eps (a float32 scalar); with ``ROTARY`` the next four, the tables cos and
    signed sin [M, D], the heads of a group and how many of them rotate (int32 scalars): those as ``rotary``
    (addresses, D, group, rotated); in ``ADD`` mode the last operand, the residual, is out's own buffer."""
    args, rets = arguments(frame, 12)
    x_data, x_dims = buffer(args, 0)
    w_data, w_dims = buffer(args, 1)
    layer, mode = scalar_i32(args, 2), scalar_i32(args, 3)
    w_addr = address(w_data) + layer * w_dims[1] * w_dims[2] * PANEL * 4
    tiles, at = 0, 4
    if mode & TILED:
        tiles, at = address(buffer(args, at)[0]) + layer * w_dims[1] * w_dims[2] // 32 * 6 * amx_kernel.TILE, at + 1
    norm, eps = 0, np.float32(0.0)
    if mode & NORMED:
        norm, eps, at = address(buffer(args, at)[0]), ffi.scalar_f32(args, at + 1), at + 2
    rotary = (0, 0, 1, 1, 0)  # the tables' addresses, head width, group, rotated heads
    if mode & ROTARY:
        cos_data, cos_dims = buffer(args, at)
        rotary = (address(cos_data), address(buffer(args, at + 1)[0]), cos_dims[1], scalar_i32(args, at + 2),
                  scalar_i32(args, at + 3))
    return (mode, address(x_data), w_addr, address(buffer(rets, 0)[0]), tiles, x_dims[0], x_dims[1], w_dims[1], norm,
            eps, rotary)


@numba.njit(inline="always")
def _by_mode(glu, matmul, amx, mode, x_addr, w_addr, out_addr, tiles, m, kc, panels):
    if mode & AMX:
        plain = mode & ~(AMX | TILED)
        amx(x_addr, w_addr, out_addr, m, kc, panels, plain == GATED, plain == ADD, tiles)
    elif mode == GATED:
        glu(x_addr, w_addr, out_addr, m, kc, panels)
    else:
        matmul(x_addr, w_addr, out_addr, m, kc, panels, mode == ADD)


@numba.njit(inline="always")
def _whole_frame(frame):
    return (frame,)


@numba.njit(inline="always")
def _split(frame, split):
    """``SPLIT`` mode: every panel of w [L, P, Kc, PANEL] (the second operand) -> its AMX tiles, out [L, P, Kc / 32,
    6 x 512] uint16."""
    args, rets = arguments(frame, 2)
    w_data, w_dims = buffer(args, 1)
    split(address(w_data), w_dims[0] * w_dims[1], w_dims[2], address(buffer(rets, 0)[0]))


@numba.njit(inline="always")
def _call(frame, routed, glu, matmul, amx, split, normed, rotate):
    """The call's kernel on its operands: the routed experts (``ROUTED`` mode), a weight's split into AMX's tiles
    (``SPLIT``), or a dense matmul (on AMX's tiles where the mode has ``AMX``; of x RMS-normed by ``normed`` first
    where it has ``NORMED``; its heads rotated by ``rotate`` after where it has ``ROTARY``)."""
    mode = scalar_i32(arguments(frame, 4)[0], 3)
    if mode == ROUTED:
        x, gate_up, first, down, chosen, weights, out, t, e, gu_panels, fm = _routed_operands(frame)
        routed(x, gate_up, first, down, chosen, weights, out, t, e, gu_panels, fm)
    elif mode == SPLIT:
        _split(frame, split)
    else:
        mode, x, w, out, tiles, m, kc, panels, norm, eps, rotary = _operands(frame)
        plain = mode & ~(NORMED | ROTARY)
        if mode & NORMED:
            xn = normed(x, norm, eps, m, kc)
            _by_mode(glu, matmul, amx, plain, xn.ctypes.data, w, out, tiles, m, kc, panels)
            xn[0] = 0  # (xn is read through its address above: a use after the call keeps numba from freeing it first)
        else:
            _by_mode(glu, matmul, amx, plain, x, w, out, tiles, m, kc, panels)
        if mode & ROTARY:
            rotate(out, m, panels * PANEL, *rotary)


@numba.njit
def _no_amx(x_addr, w_addr, out_addr, m, kc, panels, gated, add, tiles):
    """The AMX path where numba's target has no AMX (``select`` never asks for it there): nothing to compile."""
    return 0


@numba.njit
def _no_split(w_addr, panels, kc, tiles):
    return 0


# (the AMX path adds ~7 s to a cold build of the handler: only where it can run)
_amx, _amx_parallel, _split_panels = ((amx_kernel.matmul, amx_kernel.matmul_parallel, amx_kernel.split_panels)
                                      if isa.amx() else (_no_amx, _no_amx, _no_split))


@numba.njit
def _dense(frame):
    _call(frame, _routed, _glu, _matmul, _amx, _split_panels, _normed, _rotate)


@numba.njit
def _dense_parallel(frame):
    _call(frame, _routed_parallel, _glu_parallel, _matmul_parallel, _amx_parallel, _split_panels, _normed_parallel,
          _rotate_parallel)


def _handler(frame_addr):  # compiled by compile_handler
    return serve(frame_addr, _whole_frame, _dense)


def _handler_parallel(frame_addr):  # the same over numba's threads
    return serve(frame_addr, _whole_frame, _dense_parallel)


compile_handler = handler_compiler(_handler, _handler_parallel)
