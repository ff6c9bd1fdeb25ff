"""Counted loops of LLVM IR for the CPU kernels' microkernels (numba intrinsics; imported only where a kernel is
built): sums carried from one trip to the next in registers, where numba's own loops would keep them in memory."""

from __future__ import annotations

from llvmlite import ir

I64 = ir.IntType(64)


def fma(builder: ir.IRBuilder, lanes: int) -> ir.Function:
    """LLVM's fused multiply-add over ``lanes`` float32 lanes (declared once per module)."""
    vec = ir.VectorType(ir.FloatType(), lanes)
    name = f"llvm.fma.v{lanes}f32"
    return builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(vec, [vec] * 3), name=name)


def splat(builder: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """``value`` (a float) in every one of ``lanes`` lanes."""
    undef = ir.Constant(ir.VectorType(value.type, lanes), ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


class CountedLoop:
    """``for index in range(count)`` whose trips carry values (``carried``, ``starts`` on entry): built where the
    builder is, which it leaves in the loop's body; ``close(new)`` ends a trip with the carried values' next ones,
    and leaves the builder after the loop, returning their values there (``starts`` where ``count`` <= 0)."""

    def __init__(self, builder: ir.IRBuilder, count: ir.Value, name: str, starts: list[ir.Value]):
        self.builder, self.count, self.starts = builder, count, list(starts)
        self.entry = builder.block
        self.body = builder.function.append_basic_block(f"{name}.loop")
        self.after = builder.function.append_basic_block(f"{name}.done")
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(I64, 0)), self.body, self.after)
        builder.position_at_end(self.body)
        self.index = builder.phi(I64)
        self.carried = [builder.phi(s.type) for s in self.starts]

    def close(self, new: list[ir.Value]) -> list[ir.Value]:
        builder, latch = self.builder, self.builder.block  # the block that ends a trip (the body may branch)
        index_next = builder.add(self.index, ir.Constant(I64, 1))
        builder.cbranch(builder.icmp_signed("<", index_next, self.count), self.body, self.after)
        self.index.add_incoming(ir.Constant(I64, 0), self.entry)
        self.index.add_incoming(index_next, latch)
        builder.position_at_end(self.after)
        finals = [builder.phi(s.type) for s in self.starts]
        for phis in (self.carried, finals):
            for phi, start, value in zip(phis, self.starts, new, strict=True):
                phi.add_incoming(start, self.entry)
                phi.add_incoming(value, latch)
        return finals
