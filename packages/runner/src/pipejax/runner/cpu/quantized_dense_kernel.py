"""The CPU dense-matmul kernel over weights kept quantized: numba code behind an XLA FFI handler
(``cpu.quantized_dense`` is the JAX side). Imported only when a CPU stage first traces a step over quantized
panels, like ``dense_kernel``.

``x [M, K] @ w -> [M, N]`` for a weight ``w`` [K, N] kept quantized (``quantized``) in panels of 32 output
columns: the integers ``q`` [N / 32, K, 32] (int8; for the 4-bit formats [N / 32, K / 2, 32] bytes of two
nibbles, GGUF's order in blocks of 32 k's) and the scales [N / 32, K / B, 32] (``offset`` too for Q4_1) of blocks
of B k's (32; K for INT8). Each panel streams from memory once, in order, as its integers: a quarter of the
float32 weight's bytes (8-bit) or about a sixth (4-bit), which is what a decode step's few rows wait for.

Few rows: the microkernel (LLVM IR, as ``dense_kernel``'s) converts one row of 32 integers to floats in registers
(sign- or zero-extended, nibbles masked and shifted out first) and adds x[r, k] times it into block accumulators
for a tile of rows; after each block of 32 k's, ``out = fma(block sum, scale, out)`` per column (Q4_1 adds
``offset * sum_k x[r, k]``; Q4_0's ``- 8`` starts its block sums at ``-8 * sum_k x[r, k]`` instead of costing an
instruction per element). The running output tile stays in the destination (read and written once a block), so
that the registers go to the block accumulators (``TILES``). Many rows (``DEQUANTIZED_ROWS_*``): converting a
panel for every tile of rows would cost each tile its conversions again, so CHUNK k's of the panel at a time are
dequantized into an L1 buffer once and multiplied by every row there by the float32 kernel's tiles.

Measured on a 2-core AVX-512 EPYC (Zen 4), one thread, SmolLM2-135M's gate_up 576 -> 2 x 1536 and down 1536 -> 576
with 30 layers cycling (the weights come from memory), the kernels called directly: at one row the float32 kernel
streams 26-34 GB/s and this one converts a k of a panel in 1.3-1.8 ns, 2.1-2.6x (8-bit) and 2.2-2.9x (4-bit)
faster; at 64 rows it takes 1.07-1.11x the float32 kernel's time (the dequantized chunks' conversions: ~5 cycles
a k of a panel, against 8 tiles x 16 cycles of FMAs). ``benchmarks/probes/quantized_dense_probe.py`` measures the
set through XLA.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pipejax.runner.cpu.dense_kernel import rows_plus_panel, rows_times_panel
from pipejax.runner.cpu.ffi import address, arguments, buffer, handler_compiler, ptr, scalar_i32, serve
from pipejax.runner.cpu.isa import vector_lanes
from pipejax.runner.cpu.quantized_dense import ADD, GATED, KIND_8BIT, KIND_Q4_0, KIND_Q4_1
from pipejax.runner.cpu.vector_exp import exp_f32
from pipejax.runner.panels import PANEL

BLOCK = 32  # k's per block accumulator pass (every format's blocks are whole multiples of it)
LANES = vector_lanes()  # float32 lanes of the target's vector registers
VECTORS = PANEL // LANES  # registers per row of a tile
# The microkernels, tallest first: (rows, (chains, step) of 8-bit, (chains, step) of 4-bit, pairs). A tile keeps
# rows x VECTORS x chains block accumulators in registers (8 or more where the registers allow, for the FMA latency)
# besides the converted weights and a broadcast; an iteration of its loop converts ``step`` rows of integers (4-bit
# ``pairs``: a byte row's two nibbles, k = j and j + 16, at once; else one k an iteration, its nibbles shifted out
# by its k: with 8 rows and pairs LLVM hoists all 16 broadcasts of x and spills). Measured on an AVX-512 EPYC
# (Zen 4, cycles per k of one panel, its data in L1): 1 row 4.6 (8-bit) and 4.7 (4-bit), the float32 kernel's 4.2
# (FMA latency); 8 rows 18.7 and 22, float32 16.1; AVX2 code on the same CPU: 1 row 4.0 and 4.9 (4-bit pairs; 6.6
# one k an iteration), 2 rows 6.5 and 6.2 (9.1).
TILES = (((8, (1, 1), (1, 1), False), (4, (1, 1), (1, 1), True), (2, (2, 2), (2, 1), True),
          (1, (4, 4), (4, 2), True)) if VECTORS <= 2
         else ((2, (1, 1), (1, 1), True), (1, (1, 1), (2, 2), True)))


def _microkernel(kind: int, rows: int, chains: int, step: int, pairs: bool):
    """An intrinsic ``(x, ldx, q, scale, offset, xsum, ldxs, out, ldo, blocks, chunks)`` (addresses; strides in
    elements): ``out[r, :32] = sum_k x[r, k] * w[k, :32]`` for ``rows`` rows of x and one quantized panel: ``q``
    its integers, ``scale`` (and ``offset``, Q4_1) its [blocks, 32] floats, each block ``chunks`` x 32 k's long;
    ``xsum`` [rows, ldxs]: the sum of x over each 32 k's (read by the 4-bit kinds only). See ``TILES`` for the
    rest."""
    packed = kind != KIND_8BIT
    q_rows = BLOCK // 2 if packed and pairs else BLOCK  # rows (of integers, or of k's) per 32 k's
    assert q_rows % step == 0 and (2 if packed and pairs else 1) * step >= chains

    @intrinsic
    def kernel(typingctx, x, ldx, q, scale, offset, xsum, ldxs, out, ldo, blocks, chunks):
        sig = types.void(*(types.int64,) * 11)

        def codegen(context, builder, signature, args):
            x_addr, ldx, q_addr, s_addr, o_addr, xs_addr, ldxs, out_addr, ldo, blocks, chunks = args
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vec, bytes_, ints = ir.VectorType(f32, LANES), ir.VectorType(i8, LANES), ir.VectorType(i32, LANES)
            module, fn = builder.module, builder.function
            name = f"llvm.fma.v{LANES}f32"
            fma = module.globals.get(name) or ir.Function(module, ir.FunctionType(vec, [vec] * 3), name=name)
            x0, s0, o0, xs0, out0 = (builder.inttoptr(a, f32.as_pointer())
                                     for a in (x_addr, s_addr, o_addr, xs_addr, out_addr))
            q0 = builder.inttoptr(q_addr, i8.as_pointer())
            zero, undef = ir.Constant(vec, [0.0] * LANES), ir.Constant(vec, ir.Undefined)
            splat_mask = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
            undef_ints, low_ints = ir.Constant(ints, ir.Undefined), ir.Constant(ints, [15] * LANES)
            four = ir.Constant(ints, [4] * LANES)

            def c64(v):
                return ir.Constant(i64, v)

            def splat(value):
                return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(i32, 0)), undef,
                                              splat_mask)

            def load_vec(base, at, ty):
                return builder.load(builder.bitcast(builder.gep(base, [at]), ty.as_pointer()), align=1)

            def x_at(r, k):  # x[r, k], a scalar
                return builder.load(builder.gep(x0, [builder.add(builder.mul(c64(r), ldx), k)]))

            def xsum_at(r, block):
                return builder.load(builder.gep(xs0, [builder.add(builder.mul(c64(r), ldxs), block)]))

            entry = builder.block
            head, loop = fn.append_basic_block("qpanel.block"), fn.append_basic_block("qpanel.chunk")
            tail, done = fn.append_basic_block("qpanel.tail"), fn.append_basic_block("qpanel.done")
            builder.cbranch(builder.icmp_signed(">", blocks, c64(0)), head, done)

            # one block of scale: its accumulators start at 0 (Q4_0: chain 0 at -8 * sum_k x[r, k])
            builder.position_at_end(head)
            s = builder.phi(i64)
            init = []
            for r in range(rows):
                first = zero
                if kind == KIND_Q4_0:
                    first = splat(builder.fmul(ir.Constant(f32, -8.0), xsum_at(r, s)))
                init += [first if c == 0 else zero for _ in range(VECTORS) for c in range(chains)]
            builder.branch(loop)

            # the block's k's, ``step`` rows of integers an iteration: each row converted in registers, then one FMA
            # per row of x and vector (k's in turn over the chains of accumulators)
            builder.position_at_end(loop)
            i = builder.phi(i64)  # the iteration's first row of integers in the block
            acc = [builder.phi(vec) for _ in init]  # [r][h][c]
            block_rows = builder.mul(chunks, c64(q_rows))
            first_row = builder.add(builder.mul(s, block_rows), i)
            new = list(acc)

            def add_row(k, t, weights):
                for r in range(rows):
                    xv = splat(x_at(r, k))
                    for h in range(VECTORS):
                        j = (r * VECTORS + h) * chains + t % chains
                        new[j] = builder.call(fma, [xv, weights[h], new[j]])

            def integers(row, convert):  # row ``row`` of the panel's integers, as float vectors
                return [builder.sitofp(convert(load_vec(q0, builder.add(builder.mul(row, c64(PANEL)), c64(h * LANES)),
                                                        bytes_)), vec) for h in range(VECTORS)]

            for u in range(step):
                row = builder.add(first_row, c64(u))
                if not packed:
                    add_row(row, u, integers(row, lambda v: builder.sext(v, ints)))
                elif pairs:  # byte row j of a block of 32 k's: k = j (low nibbles) and j + 16 (high)
                    k = builder.add(row, builder.and_(row, c64(-BLOCK // 2)))
                    add_row(k, 2 * u, integers(row, lambda v: builder.and_(builder.zext(v, ints), low_ints)))
                    add_row(builder.add(k, c64(BLOCK // 2)), 2 * u + 1,
                            integers(row, lambda v: builder.lshr(builder.zext(v, ints), four)))
                else:  # row = k, in byte row (k / 32) * 16 + k % 16: its low nibbles for k % 32 < 16, else the high
                    byte_row = builder.or_(builder.shl(builder.ashr(row, c64(5)), c64(4)), builder.and_(row, c64(15)))
                    by = builder.trunc(builder.lshr(builder.and_(row, c64(BLOCK // 2)), c64(2)), i32)  # 0 or 4
                    by = builder.shuffle_vector(builder.insert_element(undef_ints, by, ir.Constant(i32, 0)),
                                                undef_ints, splat_mask)
                    add_row(row, u, integers(byte_row, lambda v, by=by: builder.and_(
                        builder.lshr(builder.zext(v, ints), by), low_ints)))
            i_next = builder.add(i, c64(step))
            i.add_incoming(c64(0), head)
            i.add_incoming(i_next, loop)
            for a, init_a, n in zip(acc, init, new, strict=True):
                a.add_incoming(init_a, head)
                a.add_incoming(n, loop)
            builder.cbranch(builder.icmp_signed("<", i_next, block_rows), loop, tail)

            # the block's sums into the output tile: out = fma(sum, scale, out) (+ offset * sum_k x, Q4_1)
            builder.position_at_end(tail)
            first_block = builder.icmp_signed("==", s, c64(0))
            for h in range(VECTORS):
                at = builder.add(builder.mul(s, c64(PANEL)), c64(h * LANES))
                scale_v = load_vec(s0, at, vec)
                offset_v = load_vec(o0, at, vec) if kind == KIND_Q4_1 else None
                for r in range(rows):
                    sums = new[(r * VECTORS + h) * chains:(r * VECTORS + h + 1) * chains]
                    while len(sums) > 1:
                        sums = [builder.fadd(a, b) for a, b in zip(sums[0::2], sums[1::2], strict=True)]
                    dest = builder.bitcast(builder.gep(out0, [builder.add(builder.mul(c64(r), ldo), c64(h * LANES))]),
                                           vec.as_pointer())
                    old = builder.select(first_block, zero, builder.load(dest, align=4))
                    total = builder.call(fma, [sums[0], scale_v, old])
                    if offset_v is not None:
                        total = builder.call(fma, [splat(xsum_at(r, s)), offset_v, total])
                    builder.store(total, dest, align=4)
            s_next = builder.add(s, c64(1))
            s.add_incoming(c64(0), entry)
            s.add_incoming(s_next, tail)
            builder.cbranch(builder.icmp_signed("<", s_next, blocks), head, done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return kernel


def _row_tiles(kind: int):
    """``rows_times_panel`` for one kind over its microkernels: the tallest tile while it fits, then each smaller
    one at most once (the heights halve)."""
    kernels = [_microkernel(kind, rows, *(of_4 if kind != KIND_8BIT else of_8), pairs)
               for rows, of_8, of_4, pairs in TILES]
    heights = [tile[0] for tile in TILES] + [0] * (4 - len(TILES))  # a height 0 is never taken
    kernels += [kernels[-1]] * (4 - len(kernels))
    k_top, k_a, k_b, k_c = kernels
    top, r_a, r_b, r_c = heights

    @numba.njit(inline="always")
    def tiles(x_addr, ldx, q_addr, s_addr, o_addr, xs_addr, ldxs, out_addr, ldo, m, blocks, chunks):
        i = 0
        while i + top <= m:
            k_top(x_addr + i * ldx * 4, ldx, q_addr, s_addr, o_addr, xs_addr + i * ldxs * 4, ldxs,
                  out_addr + i * ldo * 4, ldo, blocks, chunks)
            i += top
        if r_a and i + r_a <= m:
            k_a(x_addr + i * ldx * 4, ldx, q_addr, s_addr, o_addr, xs_addr + i * ldxs * 4, ldxs,
                out_addr + i * ldo * 4, ldo, blocks, chunks)
            i += r_a
        if r_b and i + r_b <= m:
            k_b(x_addr + i * ldx * 4, ldx, q_addr, s_addr, o_addr, xs_addr + i * ldxs * 4, ldxs,
                out_addr + i * ldo * 4, ldo, blocks, chunks)
            i += r_b
        if r_c and i + r_c <= m:
            k_c(x_addr + i * ldx * 4, ldx, q_addr, s_addr, o_addr, xs_addr + i * ldxs * 4, ldxs,
                out_addr + i * ldo * 4, ldo, blocks, chunks)

    return tiles


_tiles_8, _tiles_q4_0, _tiles_q4_1 = _row_tiles(KIND_8BIT), _row_tiles(KIND_Q4_0), _row_tiles(KIND_Q4_1)


def _dequantizer(kind: int):
    """An intrinsic ``(q, scale, offset, buf)`` (addresses): buf [32, 32] = 32 k's of a panel dequantized, as
    ``quantized.dequantize`` computes them (``(q - zero) * scale``, the same floats; Q4_1's ``+ offset`` may be
    fused into an FMA); ``q``: their integers, ``scale``/``offset``: their block's [32] floats."""

    @intrinsic
    def dequantize(typingctx, q, scale, offset, buf):
        sig = types.void(*(types.int64,) * 4)

        def codegen(context, builder, signature, args):
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vec, bytes_, ints = ir.VectorType(f32, LANES), ir.VectorType(i8, LANES), ir.VectorType(i32, LANES)
            q0 = builder.inttoptr(args[0], i8.as_pointer())
            s0, o0, buf0 = (builder.inttoptr(a, f32.as_pointer()) for a in args[1:])

            def at(base, i, ty):
                return builder.bitcast(builder.gep(base, [ir.Constant(i64, i)]), ty.as_pointer())

            scales = [builder.load(at(s0, h * LANES, vec), align=4) for h in range(VECTORS)]
            offsets = None
            if kind == KIND_Q4_1:
                offsets = [builder.load(at(o0, h * LANES, vec), align=4) for h in range(VECTORS)]

            def store(k, h, ints_v):
                w = builder.fmul(builder.sitofp(ints_v, vec), scales[h])
                w = builder.fadd(w, offsets[h]) if offsets is not None else w
                builder.store(w, at(buf0, k * PANEL + h * LANES, vec), align=4)

            for h in range(VECTORS):
                if kind == KIND_8BIT:
                    for k in range(BLOCK):
                        store(k, h, builder.sext(builder.load(at(q0, k * PANEL + h * LANES, bytes_), align=1), ints))
                    continue
                low_mask, shift = ir.Constant(bytes_, [15] * LANES), ir.Constant(bytes_, [4] * LANES)
                zero = ir.Constant(ints, [8 if kind == KIND_Q4_0 else 0] * LANES)
                for j in range(BLOCK // 2):
                    raw = builder.load(at(q0, j * PANEL + h * LANES, bytes_), align=1)
                    store(j, h, builder.sub(builder.zext(builder.and_(raw, low_mask), ints), zero))
                    store(j + BLOCK // 2, h, builder.sub(builder.zext(builder.lshr(raw, shift), ints), zero))
            return context.get_dummy_value()

        return sig, codegen

    return dequantize


_dequantize_8, _dequantize_q4_0, _dequantize_q4_1 = (_dequantizer(k) for k in (KIND_8BIT, KIND_Q4_0, KIND_Q4_1))


@numba.njit(inline="always")
def _dequantize(kind, q_addr, s_addr, o_addr, chunks, g0, nk, buf_addr):
    """buf [nk, 32] = the k's g0 * 32 .. + nk of a panel (its integers at ``q_addr``, its scales and offsets [blocks,
    32], each block ``chunks`` x 32 k's), dequantized."""
    for g in range(g0, g0 + nk // BLOCK):
        s_g, o_g = s_addr + g // chunks * PANEL * 4, o_addr + g // chunks * PANEL * 4
        buf_g = buf_addr + (g - g0) * BLOCK * PANEL * 4
        if kind == KIND_8BIT:
            _dequantize_8(q_addr + g * BLOCK * PANEL, s_g, o_g, buf_g)
        elif kind == KIND_Q4_0:
            _dequantize_q4_0(q_addr + g * BLOCK // 2 * PANEL, s_g, o_g, buf_g)
        else:
            _dequantize_q4_1(q_addr + g * BLOCK // 2 * PANEL, s_g, o_g, buf_g)


# From this many rows on (8-bit, 4-bit), each CHUNK k's of a panel are dequantized once for the float32 tiles
# (``dense_kernel``'s) instead of converted by every tile of rows: where that measured faster (one thread, SmolLM2's
# gate_up and down, 30 layers cycling). AVX-512: at 16 rows the 8-bit tiles ran 0.81-0.85x the float32 kernel's
# speed against the dequantized chunks' 0.73-0.78x, at 32 rows level (0.84-0.86x), at 48 and 64 rows 0.76-0.77x
# against 0.88-0.90x; 4-bit at 8 rows 0.76-0.91x against 0.73-0.86x, at 16 rows 0.73-0.75x against 0.82-0.87x,
# at 64 rows 0.66-0.73x against 0.92-0.93x. AVX2 code on the same CPU: 8-bit at 8 rows 0.96x against 0.90x, at
# 16 rows 0.86x against 0.94x; 4-bit at 4 rows 1.10x against 1.01x, at 8 rows 0.74x against 1.01x.
DEQUANTIZED_ROWS_8, DEQUANTIZED_ROWS_4 = (32, 16) if VECTORS <= 2 else (16, 8)
CHUNK = 128  # k's per dequantized chunk: 16 KB of floats, in L1 with a tile's rows of x


@numba.njit(error_model="numpy")  # a call, not inlined: the panel job calls it thrice, and each has every kind
def _panel_into(kind, x_addr, kc, q_addr, s_addr, o_addr, xs_addr, panel_q, panel_s, p, dest, ldd, m,
                blocks, chunks, buf, dequantized):
    """dest [m, 32] (row stride ``ldd``) = x [m, kc] @ panel ``p``: the integers converted in the microkernel's
    registers, or (``dequantized``: calls of ``DEQUANTIZED_ROWS_*`` rows or more) each CHUNK k's of the panel
    dequantized into ``buf`` [CHUNK, 32] once and multiplied by every row there (``dense_kernel``'s float32
    tiles)."""
    q_p, s_p, o_p = q_addr + p * panel_q, s_addr + p * panel_s * 4, o_addr + p * panel_s * 4
    if dequantized:
        for k0 in range(0, kc, CHUNK):
            nk = min(CHUNK, kc - k0)
            _dequantize(kind, q_p, s_p, o_p, chunks, k0 // BLOCK, nk, buf)
            if k0 == 0:
                rows_times_panel(x_addr, kc, buf, dest, ldd, m, nk, 0)
            else:
                rows_plus_panel(x_addr + k0 * 4, kc, buf, dest, ldd, m, nk, 0)
        return
    ldxs = kc // BLOCK
    if kind == KIND_8BIT:
        _tiles_8(x_addr, kc, q_p, s_p, o_p, xs_addr, ldxs, dest, ldd, m, blocks, chunks)
    elif kind == KIND_Q4_0:
        _tiles_q4_0(x_addr, kc, q_p, s_p, o_p, xs_addr, ldxs, dest, ldd, m, blocks, chunks)
    else:
        _tiles_q4_1(x_addr, kc, q_p, s_p, o_p, xs_addr, ldxs, dest, ldd, m, blocks, chunks)


GLU_ROWS = 128  # rows per block of the gated and the residual matmul's scratch tiles (16 KB each)
SCRATCH = (2 * GLU_ROWS + CHUNK) * PANEL  # floats of a panel job's scratch: the gate and up tiles, the chunk


@intrinsic
def _stack_scratch(typingctx):
    """The address of SCRATCH floats (64-byte aligned) on the stack of the calling function (its entry block's
    alloca: once per call, not per loop iteration), so that a panel job allocates nothing: a heap allocation
    per job would cost a decode step's small panels a good part of their time."""

    def codegen(context, builder, signature, args):
        with builder.goto_entry_block():
            scratch = builder.alloca(ir.ArrayType(ir.FloatType(), SCRATCH))
            scratch.align = 64
        return builder.ptrtoint(scratch, ir.IntType(64))

    return types.int64(), codegen


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def _panel_job(mode, kind, x_addr, kc, q_addr, s_addr, o_addr, xs_addr, panel_q, panel_s, p, out_addr, m, n,
               blocks, chunks, scratch):
    """Panel ``p``'s share of the call: out[:, p * 32:][:32] = x @ panel p (``ADD``: += it, once complete);
    ``GATED``: = silu(x @ panel p) * (x @ panel p + P / 2), with ``out`` [m, n] n = P / 2 * 32. ``scratch``: the
    address of SCRATCH floats."""
    gate_addr, up_addr = scratch, scratch + GLU_ROWS * PANEL * 4
    buf = scratch + 2 * GLU_ROWS * PANEL * 4
    # the call's rows decide, so that its row blocks below round alike
    dequantized = m >= (DEQUANTIZED_ROWS_8 if kind == KIND_8BIT else DEQUANTIZED_ROWS_4)
    if mode != GATED and mode != ADD:
        _panel_into(kind, x_addr, kc, q_addr, s_addr, o_addr, xs_addr, panel_q, panel_s, p,
                    out_addr + p * PANEL * 4, n, m, blocks, chunks, buf, dequantized)
        return
    out = numba.carray(ptr(out_addr), (m, n), np.float32)
    gate = numba.carray(ptr(gate_addr), (GLU_ROWS, PANEL), np.float32)
    up = numba.carray(ptr(up_addr), (GLU_ROWS, PANEL), np.float32)
    ldxs = kc // BLOCK
    for b0 in range(0, m, GLU_ROWS):
        rows = min(GLU_ROWS, m - b0)
        x_b, xs_b = x_addr + b0 * kc * 4, xs_addr + b0 * ldxs * 4
        _panel_into(kind, x_b, kc, q_addr, s_addr, o_addr, xs_b, panel_q, panel_s, p, gate_addr, PANEL, rows,
                    blocks, chunks, buf, dequantized)
        if mode == GATED:
            _panel_into(kind, x_b, kc, q_addr, s_addr, o_addr, xs_b, panel_q, panel_s, p + n // PANEL, up_addr,
                        PANEL, rows, blocks, chunks, buf, dequantized)
            for i in range(rows):
                o, g, u = out[b0 + i, p * PANEL:(p + 1) * PANEL], gate[i], up[i]
                for c in range(PANEL):
                    o[c] = g[c] / (np.float32(1.0) + exp_f32(-g[c])) * u[c]
        else:
            for i in range(rows):
                o, g = out[b0 + i, p * PANEL:(p + 1) * PANEL], gate[i]
                for c in range(PANEL):
                    o[c] = o[c] + g[c]


@numba.njit(inline="always")
def _xsum(kind, x_addr, m, kc):
    """sum_k x[r, k] over each 32 k's [m, kc / 32] (the 4-bit kinds' offset terms; empty for 8-bit)."""
    if kind == KIND_8BIT:
        return np.empty((1, 1), np.float32)  # (not np.zeros: in a parallel function, a loop of its own)
    x = numba.carray(ptr(x_addr), (m, kc), np.float32)
    sums = np.empty((m, kc // BLOCK), np.float32)
    for r in range(m):
        for b in range(kc // BLOCK):
            total = np.float32(0.0)
            for k in range(b * BLOCK, (b + 1) * BLOCK):
                total += x[r, k]
            sums[r, b] = total
    return sums


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _dense(mode, kind, x_addr, q_addr, s_addr, o_addr, out_addr, m, kc, panels, panel_q, blocks):
    """The call on the calling thread (see ``_operands`` for the arguments)."""
    xsum = _xsum(kind, x_addr, m, kc)
    chunks, panel_s, jobs = kc // BLOCK // blocks, blocks * PANEL, panels // 2 if mode == GATED else panels
    scratch = _stack_scratch()
    for p in range(jobs):
        _panel_job(mode, kind, x_addr, kc, q_addr, s_addr, o_addr, xsum.ctypes.data, panel_q, panel_s, p, out_addr,
                   m, jobs * PANEL, blocks, chunks, scratch)


@numba.njit(fastmath=True, error_model="numpy", cache=True, parallel=True)
def _dense_parallel(mode, kind, x_addr, q_addr, s_addr, o_addr, out_addr, m, kc, panels, panel_q, blocks):
    """The same with the panels (gated: the panel pairs) spread over numba's threads (TBB)."""
    xsum = _xsum(kind, x_addr, m, kc)
    chunks, panel_s, jobs = kc // BLOCK // blocks, blocks * PANEL, panels // 2 if mode == GATED else panels
    for p in numba.prange(jobs):
        _panel_job(mode, kind, x_addr, kc, q_addr, s_addr, o_addr, xsum.ctypes.data, panel_q, panel_s, p, out_addr,
                   m, jobs * PANEL, blocks, chunks, _stack_scratch())


@numba.njit(inline="always")
def _operands(frame):
    """The call's mode (``quantized_dense.PLAIN``, ``GATED`` or ``ADD``) and kind (``KIND_8BIT``, ``KIND_Q4_0``,
    ``KIND_Q4_1``); the addresses of x, of layer ``layer``'s integers, scales and offsets, of out; rows, contraction,
    panels, bytes of integers per panel and blocks of scale per panel. Operands: x [M, K] float32, q [L, P, Kq, 32]
    int8/uint8, scale and offset [L, P, blocks, 32] float32 (offset: any array but for Q4_1), then int32 scalars
    layer, mode, kind; in ``ADD`` mode an eighth, the residual, is out's own buffer."""
    args, rets = arguments(frame, 7)
    x_data, x_dims = buffer(args, 0)
    q_data, q_dims = buffer(args, 1)
    s_data, s_dims = buffer(args, 2)
    o_data, _ = buffer(args, 3)
    layer, mode, kind = scalar_i32(args, 4), scalar_i32(args, 5), scalar_i32(args, 6)
    panels, panel_q, blocks = q_dims[1], q_dims[2] * PANEL, s_dims[2]
    q_addr = address(q_data) + layer * panels * panel_q
    s_addr = address(s_data) + layer * panels * blocks * PANEL * 4
    o_addr = address(o_data) + layer * panels * blocks * PANEL * 4 if kind == KIND_Q4_1 else address(o_data)
    return (mode, kind, address(x_data), q_addr, s_addr, o_addr, address(buffer(rets, 0)[0]), x_dims[0], x_dims[1],
            panels, panel_q, blocks)


def _handler(frame_addr):  # compiled by compile_handler
    return serve(frame_addr, _operands, _dense)


def _handler_parallel(frame_addr):  # the same over numba's threads
    return serve(frame_addr, _operands, _dense_parallel)


compile_handler = handler_compiler(_handler, _handler_parallel)
