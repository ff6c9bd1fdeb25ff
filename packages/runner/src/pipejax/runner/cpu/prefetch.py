"""Software prefetch for the CPU kernels (numba code; imported only where a kernel is built): a hint that brings a
cache line into L2 ahead of its use, for reads whose next address the hardware prefetcher cannot guess (a paged
cache's next block) or would start too late (the next weight panel)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

LINE = 64  # bytes per cache line on x86


def emit(builder: ir.IRBuilder, address: ir.Value) -> None:
    """Prefetch the line at the int64 ``address`` into L2: read (0), locality 2, data (1), which is ``prefetcht1``
    on x86. A hint: an address past an array's end is harmless."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    module = builder.module
    fn = module.globals.get("llvm.prefetch.p0") or ir.Function(
        module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name="llvm.prefetch.p0")
    builder.call(fn, [builder.inttoptr(address, i8p), ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])


@intrinsic
def prefetch(typingctx, address):
    """``prefetch(address)``: ``emit`` for one line, from numba code (``address`` an int64)."""
    def codegen(context, builder, signature, args):
        emit(builder, args[0])
        return context.get_dummy_value()

    return types.void(types.int64), codegen
