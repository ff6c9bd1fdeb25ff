"""The dense kernel's matmuls on AMX's bf16 tiles, at fp32 accuracy (numba code; ``dense_kernel`` calls it for a call
whose mode carries ``dense.AMX``, which ``select`` sets where it measured this faster than the FMA tiles).

Each fp32 operand is split into three bf16 pieces rounded to nearest, ``v = hi + mid + lo`` exactly, and the six
products that matter (hi·hi, hi·mid, mid·hi, mid·mid, hi·lo, lo·hi) accumulate in fp32 in ``tdpbf16ps``: the three
left out are below fp32's rounding of a product (the bf16x6 scheme of XLA:TPU's highest precision). Against a
float64 matmul its largest error is about half the FMA kernel's (``benchmarks/probes/amx_dense_probe.py``).

A call splits x into 16 x 32 tiles (per block of 16 rows and of 32 k's, 3 pieces) and every panel of the weight
into its pieces' tiles (per block of 32 k's, 3 pieces x 2 halves of 16 columns, in AMX's pair-interleaved layout),
then runs the rows in groups whose x tiles stay in L2: each thread takes panels, and each pair of row blocks the
whole contraction in four accumulator tiles (2 row blocks x 2 halves). The split tiles live in 2 MB pages
(``madvise``): the tile loads from 4 KB pages ran at about half the rate on an Intel Xeon of this workplace.

Only a numba target with ``amx-tile`` and ``amx-bf16`` (``isa.amx``) compiles this module's functions
(``dense_kernel`` takes a stub elsewhere, and ``select`` never sets the mode): LLVM cannot emit them for another.
A process must be granted the tiles' state (``isa.grant_amx``) before the first call.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pipejax.runner.cpu.ffi import float32s
from pipejax.runner.cpu.vector_exp import exp_f32
from pipejax.runner.panels import PANEL

TILE = 1024  # bytes: every tile here is 16 rows x 64 bytes
HUGE_PAGE = 2 << 20
GROUP_ROWS = 256  # rows whose x tiles (256 x 768 x 6 bytes) stay in L2 while every panel reads them; half for kc > 1024
_CONFIG = np.zeros(64, np.uint8)  # ldtilecfg's: palette 1, tiles 0-7 of 16 rows x 64 bytes
_CONFIG[0], _CONFIG[48:56] = 1, 16
_CONFIG[16:32].view(np.uint16)[:8] = 64


def _function(module: ir.Module, name: str, ret: ir.Type, args: list) -> ir.Function:
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args), name=name)


@intrinsic
def _tile_config(typingctx, config):
    """ldtilecfg from the 64 bytes at int64 address ``config``."""
    def codegen(context, builder, signature, args):
        p = ir.IntType(8).as_pointer()
        load = _function(builder.module, "llvm.x86.ldtilecfg", ir.VoidType(), [p])
        builder.call(load, [builder.inttoptr(args[0], p)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, signature, args):
        builder.call(_function(builder.module, "llvm.x86.tilerelease", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


# One block of 32 k's in ``_pair_times_panel``, in order: ("p", r, h) a product into accumulator 2 r + h (row block r,
# half h); ("x", r, q, ahead) row block r's piece q (0 hi, 1 mid, 2 lo) into tile 4 + r; ("w", h, q, ahead) half h's
# piece q into tile 6 + h; ``ahead``: the next block's (block 0's are loaded before the loop). Each load comes right
# after its tile's last product and at least one product before its first: 14 loads (12 is the least).
_P00, _P01, _P10, _P11 = ("p", 0, 0), ("p", 0, 1), ("p", 1, 0), ("p", 1, 1)
BLOCK_ORDER = (
    _P00, _P10, ("w", 0, 1, False), _P01, _P11, ("w", 1, 1, False),  # x hi times w lo
    _P00, _P10, ("w", 0, 0, False), _P01, _P11, ("w", 1, 0, False),  # x hi times w mid
    _P00, _P01, ("x", 0, 2, False), _P10, _P11, ("x", 1, 2, False),  # x hi times w hi
    _P00, _P01, ("x", 0, 1, False), _P10, _P11, ("x", 1, 1, False),  # x lo times w hi
    _P00, _P10, ("w", 0, 1, False), _P01, _P11, ("w", 1, 1, False),  # x mid times w hi
    _P00, _P10, ("w", 0, 2, True), _P01, ("x", 0, 0, True), _P11, ("w", 1, 2, True), ("x", 1, 0, True),  # x mid, w mid
)


@intrinsic
def _pair_times_panel(typingctx, x0, x1, w, c, kblocks):
    """c [32, 32] fp32 (rows 128 bytes apart) = row blocks x0 and x1 (``kblocks`` x 3 pieces' tiles each) times one
    panel's tiles w (``kblocks`` x 3 pieces x 2 halves). Tiles 0-3 accumulate, 4-5 hold x's pieces, 6-7 w's, each
    block in ``BLOCK_ORDER``: on an Intel Xeon of this workplace a tile load cost ~10 ns that no product overlapped
    (a product 5.6 ns; ``benchmarks/probes/amx_tile_loads.py``), most likely because a tile has no second copy to
    load into while products still read it."""
    def codegen(context, builder, signature, args):
        x0, x1, w, c, kb_n = args
        i8, i64 = ir.IntType(8), ir.IntType(64)
        p, module, void = i8.as_pointer(), builder.module, ir.VoidType()
        load = _function(module, "llvm.x86.tileloadd64", void, [i8, p, i64])
        store = _function(module, "llvm.x86.tilestored64", void, [i8, p, i64])
        zero = _function(module, "llvm.x86.tilezero", void, [i8])
        dp = _function(module, "llvm.x86.tdpbf16ps", void, [i8] * 3)
        tile, const = (lambda t: ir.Constant(i8, t)), (lambda v: ir.Constant(i64, v))

        def emit(op, kb):
            kind, a, b = op[:3]
            if kind == "p":  # row block a times half b
                builder.call(dp, [tile(2 * a + b), tile(4 + a), tile(6 + b)])
                return
            base, block, offset, t = ((x0, x1)[a], 3 * TILE, b * TILE, 4 + a) if kind == "x" else \
                (w, 6 * TILE, (2 * b + a) * TILE, 6 + a)
            at = builder.add(base, builder.add(builder.mul(kb, const(block)), const(offset)))
            builder.call(load, [tile(t), builder.inttoptr(at, p), const(64)])

        for t in range(4):
            builder.call(zero, [tile(t)])
        loop, done = builder.function.append_basic_block("kb"), builder.function.append_basic_block("kb.done")
        with builder.if_then(builder.icmp_signed(">", kb_n, const(0))):  # block 0's first tiles
            for op in BLOCK_ORDER:
                if op[0] != "p" and op[3]:
                    emit(op, const(0))
        entry = builder.block
        builder.cbranch(builder.icmp_signed(">", kb_n, const(0)), loop, done)
        builder.position_at_end(loop)
        kb = builder.phi(i64)
        kb.add_incoming(const(0), entry)
        k_next = builder.add(kb, const(1))
        ahead = builder.select(builder.icmp_signed("<", k_next, kb_n), k_next, kb)  # (the last block: itself again)
        for op in BLOCK_ORDER:
            emit(op, ahead if op[0] != "p" and op[3] else kb)
        kb.add_incoming(k_next, builder.block)
        builder.cbranch(builder.icmp_signed("<", k_next, kb_n), loop, done)
        builder.position_at_end(done)
        for t, offset in enumerate((0, 64, 16 * 128, 16 * 128 + 64)):
            builder.call(store, [tile(t), builder.inttoptr(builder.add(c, const(offset)), p), const(128)])
        return context.get_dummy_value()

    return types.void(*[types.int64] * 5), codegen


class _BFloat(ir.Type):
    """LLVM's bfloat, for which llvmlite's IR builder has no class (numba hands LLVM the module as text)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _pieces(builder: ir.IRBuilder, v: ir.Value) -> list[ir.Value]:
    """The bf16 pieces (<N x i16>) hi, mid, lo of <N x float> v, each rounded to nearest even: v = hi + mid + lo.
    (``fptrunc`` to bfloat: one ``vcvtneps2bf16`` per 16 floats on a CPU with AVX512_BF16, as every one with AMX.)"""
    bf16s = ir.VectorType(_BFloat(), v.type.count)
    out = []
    for q in range(3):
        piece = builder.fptrunc(v, bf16s)
        out.append(builder.bitcast(piece, ir.VectorType(ir.IntType(16), v.type.count)))
        if q < 2:
            v = builder.fsub(v, builder.fpext(piece, v.type))
    return out


@intrinsic
def _split_x_row(typingctx, src, dst):
    """32 floats at src -> their pieces, 32 bf16 each, at dst, dst + TILE, dst + 2 TILE (a row of 3 x tiles)."""
    def codegen(context, builder, signature, args):
        src, dst = args
        v = builder.load(builder.inttoptr(src, ir.VectorType(ir.FloatType(), 32).as_pointer()), align=4)
        for q, piece in enumerate(_pieces(builder, v)):
            at = builder.add(dst, ir.Constant(ir.IntType(64), q * TILE))
            builder.store(piece, builder.inttoptr(at, ir.VectorType(ir.IntType(16), 32).as_pointer()), align=2)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _split_w_rows(typingctx, row0, row1, dst):
    """Rows k and k + 1 of a panel (32 floats each) -> each piece's two halves' pair-interleaved rows (k, k + 1 for
    each of 16 columns) at dst + (2 piece + half) TILE."""
    def codegen(context, builder, signature, args):
        r0, r1, dst = args
        f32s = ir.VectorType(ir.FloatType(), 32).as_pointer()
        p0, p1 = (_pieces(builder, builder.load(builder.inttoptr(r, f32s), align=4)) for r in (r0, r1))
        for q in range(3):
            for h in range(2):
                order = [i for j in range(16) for i in (16 * h + j, 32 + 16 * h + j)]
                pairs = builder.shuffle_vector(p0[q], p1[q], ir.Constant(ir.VectorType(ir.IntType(32), 32), order))
                at = builder.add(dst, ir.Constant(ir.IntType(64), (2 * q + h) * TILE))
                builder.store(pairs, builder.inttoptr(at, ir.VectorType(ir.IntType(16), 32).as_pointer()), align=2)
        return context.get_dummy_value()

    return types.void(*[types.int64] * 3), codegen


@intrinsic
def _advise_huge_pages(typingctx, address, length):
    """madvise(address, length, MADV_HUGEPAGE), libc's (resolved when the code is loaded); a hint: its result is
    ignored (a kernel without transparent huge pages keeps 4 KB pages)."""
    def codegen(context, builder, signature, args):
        i32, p = ir.IntType(32), ir.IntType(8).as_pointer()
        madvise = _function(builder.module, "madvise", i32, [p, ir.IntType(64), i32])
        builder.call(madvise, [builder.inttoptr(args[0], p), args[1], ir.Constant(i32, 14)])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@numba.njit(inline="always")
def _scratch(nbytes):
    """An uninitialised buffer of ``nbytes`` in 2 MB pages where the system gives them: (its owner, which must stay
    alive while the address is used; its 2 MB-aligned address). malloc hands the same memory to the next call of
    the same size, so the pages are touched once. (0 bytes: no buffer, address 0.)"""
    if nbytes == 0:
        return np.empty(0, np.uint8), 0
    owner = np.empty(nbytes + HUGE_PAGE, np.uint8)
    start = (owner.ctypes.data + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    _advise_huge_pages(start, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE)
    return owner, start


@numba.njit(inline="always")
def _split_x_block(x_addr, m, kc, xs, rb):
    """Rows 16 rb .. 16 rb + 15 of x [m, kc] -> row block rb's tiles at xs ([blocks, kc / 32, 3] tiles; rows past
    m: zeros)."""
    kb = kc // 32
    for i in range(16):
        r = rb * 16 + i
        for k in range(kb):
            dst = xs + ((rb * kb + k) * 3 * 16 + i) * 64
            if r < m:
                _split_x_row(x_addr + (r * kc + k * 32) * 4, dst)
            else:
                for q in range(3):
                    float32s(dst + q * TILE, 16)[:] = 0


@numba.njit(inline="always")
def _split_panel(w_addr, kc, p, ws):
    """Panel p of w [panels, kc, 32] -> its tiles at ws ([panels, kc / 32, 3, 2] tiles)."""
    kb, panel = kc // 32, w_addr + p * kc * PANEL * 4
    for k in range(0, kc, 2):
        dst = ws + (((p * kb + k // 32) * 6 * 16) + k % 32 // 2) * 64
        _split_w_rows(panel + k * PANEL * 4, panel + (k + 1) * PANEL * 4, dst)


@numba.njit(inline="always")
def _rows_times_panel(xs, ws, kc, p, first, rows, c):
    """c [rows, 32] = rows first .. first + rows (whole pairs of row blocks) of the split x times panel p."""
    kb = kc // 32
    _tile_config(_CONFIG.ctypes.data)
    for rb in range(first // 16, (first + rows) // 16, 2):
        _pair_times_panel(xs + rb * kb * 3 * TILE, xs + (rb + 1) * kb * 3 * TILE, ws + p * kb * 6 * TILE,
                          c.ctypes.data + (rb - first // 16) * 16 * PANEL * 4, kb)
    _tile_release()


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def _output_task(xs, ws, out_addr, m, kc, panels, first, rows, t, gated, add):
    """Output panel t of rows first .. first + rows: x @ panel t (``add``: added to out), or with ``gated``
    silu(x @ gate panel t) * (x @ up panel t + panels / 2)."""
    outs = panels // 2 if gated else panels
    product = np.empty((rows, PANEL), np.float32)
    _rows_times_panel(xs, ws, kc, t, first, rows, product)
    up = np.empty((rows if gated else 0, PANEL), np.float32)
    if gated:
        _rows_times_panel(xs, ws, kc, t + outs, first, rows, up)
    for i in range(min(rows, m - first)):
        o = float32s(out_addr + ((first + i) * outs + t) * PANEL * 4, PANEL)
        y = float32s(product.ctypes.data + i * PANEL * 4, PANEL)
        if gated:
            u = float32s(up.ctypes.data + i * PANEL * 4, PANEL)
            for c in range(PANEL):
                o[c] = y[c] / (np.float32(1.0) + exp_f32(-y[c])) * u[c]
        elif add:
            for c in range(PANEL):
                o[c] += y[c]
        else:
            for c in range(PANEL):
                o[c] = y[c]


@numba.njit(inline="always")
def _sizes(m, kc, panels):
    """Row blocks (whole pairs), x's and the weight's tile bytes, and the rows of a group."""
    blocks, group = -(-m // 32) * 2, GROUP_ROWS if kc <= 1024 else GROUP_ROWS // 2
    return blocks, blocks * kc // 32 * 3 * TILE, panels * kc // 32 * 6 * TILE, group


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def matmul(x_addr, w_addr, out_addr, m, kc, panels, gated, add, tiles):
    """out [m, N] = x [m, kc] @ w (panels [panels, kc, 32]; ``add``: +=), or with ``gated`` silu(gate) * up over the
    panels' halves (N = panels / 2 x 32), on the calling thread. kc: whole blocks of 32. ``tiles``: the address of
    w's tiles as ``split_panels`` wrote them (0: split here)."""
    blocks, x_bytes, w_bytes, group = _sizes(m, kc, panels)
    x_owner, xs = _scratch(x_bytes)
    w_owner, ws = _scratch(0 if tiles else w_bytes)
    for rb in range(blocks):
        _split_x_block(x_addr, m, kc, xs, rb)
    if tiles:
        ws = tiles
    else:
        for p in range(panels):
            _split_panel(w_addr, kc, p, ws)
    for first in range(0, blocks * 16, group):
        for t in range(panels // 2 if gated else panels):
            _output_task(xs, ws, out_addr, m, kc, panels, first, min(group, blocks * 16 - first), t, gated, add)
    return x_owner.size + w_owner.size  # the scratch alive to here


@numba.njit(fastmath=True, error_model="numpy", cache=True, parallel=True)
def matmul_parallel(x_addr, w_addr, out_addr, m, kc, panels, gated, add, tiles):
    """The same with the row blocks, the panels and then the output panels of each group spread over numba's
    threads (TBB)."""
    blocks, x_bytes, w_bytes, group = _sizes(m, kc, panels)
    x_owner, xs = _scratch(x_bytes)
    w_owner, ws = _scratch(0 if tiles else w_bytes)
    for rb in numba.prange(blocks):
        _split_x_block(x_addr, m, kc, xs, rb)
    if tiles:
        ws = tiles
    else:
        for p in numba.prange(panels):
            _split_panel(w_addr, kc, p, ws)
    outs = panels // 2 if gated else panels  # (computed in the prange's own header, the loop ran serially)
    for first in range(0, blocks * 16, group):
        rows = min(group, blocks * 16 - first)
        for t in numba.prange(outs):
            _output_task(xs, ws, out_addr, m, kc, panels, first, rows, t, gated, add)
    return x_owner.size + w_owner.size


@numba.njit(cache=True, parallel=True)
def split_panels(w_addr, panels, kc, tiles):
    """Every panel of w (``panels`` of them, [panels, kc, 32]: all layers' of a stacked weight) -> its tiles at
    ``tiles`` (``panels`` x kc / 32 x 6 tiles, the layout ``matmul`` reads), once: a weight kept with its tiles skips
    the split at every call. Their pages are advised 2 MB before the first write (the buffer is untouched)."""
    first = (tiles + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (tiles + panels * kc // 32 * 6 * TILE) // HUGE_PAGE * HUGE_PAGE
    if end > first:
        _advise_huge_pages(first, end - first)
    for p in numba.prange(panels):
        _split_panel(w_addr, kc, p, tiles)
