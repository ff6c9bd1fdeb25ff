"""What a tile load costs AMX's products on this CPU: one core runs 24 bf16 tile products (``tdpbf16ps``, 2 row
blocks x 2 column halves) per round, with and without tile loads between them, over operands that stay in L1
(12 KB of random bf16: real data, not the zero page). Each round's loads follow one of the orders the dense kernel
could use (``amx_kernel._pair_times_panel``); a load's cost is the round's time above the products alone, per load.
Needs a CPU with ``amx_bf16`` in /proc/cpuinfo.

    python benchmarks/probes/amx_tile_loads.py [--rounds 200000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _product(r: int, h: int) -> tuple:
    return ("dp", 2 * r + h, 4 + r, 6 + h)


def _x(r: int, q: int) -> tuple:
    return ("load", 4 + r, 3 * r + q)  # (tile, KB offset)


def _w(h: int, q: int) -> tuple:
    return ("load", 6 + h, 6 + 2 * q + h)


def _as_probe_op(op: tuple) -> tuple:
    """An op of ``amx_kernel.BLOCK_ORDER`` in this probe's terms (a load ahead reads this block's place)."""
    return _product(op[1], op[2]) if op[0] == "p" else (_x if op[0] == "x" else _w)(op[1], op[2])


def orders() -> dict[str, list[tuple]]:
    """Rounds of 24 products: alone; 16 loads (each piece's tiles loaded just before its products: the kernel
    before 947e01c); 14 loads (the kernel's own ``BLOCK_ORDER``); 24 loads (a plain bf16 GEMM's order, a load per
    product)."""
    from pipejax.runner.cpu import amx_kernel

    four = [_product(r, h) for r in range(2) for h in range(2)]
    before = [_x(0, 0), _x(1, 0)]
    for q in (0, 1, 2):
        before += [_w(0, q), _w(1, q), *four]
    before += [_x(0, 1), _x(1, 1)]
    for q in (1, 0):
        before += [_w(0, q), _w(1, q), *four]
    before += [_x(0, 2), _x(1, 2), *four]
    now = [_as_probe_op(op) for op in amx_kernel.BLOCK_ORDER]
    gemm = [op for _ in range(6) for op in (_x(0, 0), _w(0, 0), _product(0, 0), _w(1, 0), _product(0, 1), _x(1, 0),
                                             _product(1, 0), _product(1, 1))]
    return {"products alone": four * 6, "16 loads (before)": before, "14 loads (the kernel's)": now,
            "24 loads (GEMM)": gemm}


def timed_rounds(order: list[tuple]):
    """A numba function (rounds, address) running ``order`` ``rounds`` times on tiles loaded from ``address``."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from pipejax.runner.cpu import amx_kernel

    @intrinsic
    def body(typingctx, rounds, src):
        def codegen(context, builder, signature, args):
            n, base = args
            i8, i64 = ir.IntType(8), ir.IntType(64)
            p, void = i8.as_pointer(), ir.VoidType()
            load = amx_kernel._function(builder.module, "llvm.x86.tileloadd64", void, [i8, p, i64])
            dp = amx_kernel._function(builder.module, "llvm.x86.tdpbf16ps", void, [i8] * 3)
            tile = (lambda t: ir.Constant(i8, t))
            for t in range(8):
                builder.call(load, [tile(t), builder.inttoptr(base, p), ir.Constant(i64, 64)])
            entry = builder.block
            loop, done = builder.function.append_basic_block("round"), builder.function.append_basic_block("done")
            builder.branch(loop)
            builder.position_at_end(loop)
            i = builder.phi(i64)
            i.add_incoming(ir.Constant(i64, 0), entry)
            for op in order:
                if op[0] == "dp":
                    builder.call(dp, [tile(op[1]), tile(op[2]), tile(op[3])])
                else:
                    at = builder.add(base, ir.Constant(i64, op[2] * 1024))
                    builder.call(load, [tile(op[1]), builder.inttoptr(at, p), ir.Constant(i64, 64)])
            following = builder.add(i, ir.Constant(i64, 1))
            i.add_incoming(following, builder.block)
            builder.cbranch(builder.icmp_signed("<", following, n), loop, done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64), codegen

    @numba.njit
    def run(rounds, src):
        amx_kernel._tile_config(amx_kernel._CONFIG.ctypes.data)
        body(rounds, src)
        amx_kernel._tile_release()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200_000)
    args = parser.parse_args()
    from pipejax.runner.cpu import dense

    if not dense.amx_ready():
        raise SystemExit("no AMX bf16 tiles for this process here (amx_bf16 not in /proc/cpuinfo, or not granted)")
    bits = np.random.default_rng(0).standard_normal(6 * 1024).astype(np.float32).view(np.uint32) >> 16
    src = bits.astype(np.uint16)  # 12 KB of bf16
    alone = None
    for name, order in orders().items():
        run = timed_rounds(order)
        run(10, src.ctypes.data)
        start = time.perf_counter()
        run(args.rounds, src.ctypes.data)
        ns = (time.perf_counter() - start) / args.rounds * 1e9
        products = sum(op[0] == "dp" for op in order)
        loads = len(order) - products
        alone = ns if alone is None else alone
        rate = products * 16 * 16 * 32 * 2 / ns / 1e3
        cost = f", {(ns - alone) / loads:.1f} ns a load" if loads else ""
        print(f"{name}: {ns / products:.2f} ns a product, {rate:.2f} TFLOP/s of bf16 products on one core{cost}",
              flush=True)


if __name__ == "__main__":
    main()
