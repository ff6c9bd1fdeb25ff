"""Register tiles for the CPU decode-attention kernel (numba intrinsics of LLVM IR; imported only where the kernel is
built). numba's own loops over one slot and one query head at a time spend most of their time around the
arithmetic: a horizontal sum after every 64-element dot, and every weighted value added into a sum kept in memory.
Here each tile's sums stay in registers:

- ``scores_tile``: one query head against ``LANES`` slots of one KV head, a vector register per slot over the head
  dimension, the registers summed across at the end in one transposing tree (``LANES - 1`` shuffle pairs for
  ``LANES`` scores, not a horizontal sum each);
- ``values_8`` (``_4``, ``_2``, ``_1``): one query head's weighted values over a run of slots, 8 (4, 2, 1)
  registers of the head dimension accumulating in place, loaded and stored once per run.

Both read addresses (int64) and strides in bytes; the head dimension is taken in whole vectors (``LANES`` floats),
and the caller does what remains of it. The kernel alone, 12 layers x 64 rows x 129 slots on 2 threads
(``benchmarks/probes/decode_attention_kernel.py``, before and after alternated twice; AMD EPYC Zen 2 with AVX2 only,
2026-12-07): each layer's cache from memory 10.26 and 10.14 ms against 12.80 and 12.37 with numba's loops, from the
caches 6.94 and 6.73 against 8.16 and 8.27 (with the prefetches spread over the tiles, ``decode_kernel``). With
AVX-512 the tiles are 16 slots of 16-lane vectors: on an AMD EPYC Zen 5 (2026-12-07) the same probe read 7.4-7.7 ms
from memory and 3.8-4.1 from the caches, against 6.1-6.2 ms for a plain scan of the same K and V that prefetches the
next block.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pipejax.runner.cpu import isa
from pipejax.runner.cpu.ir_loop import I64, CountedLoop, fma, splat

LANES = isa.vector_lanes()  # float32 lanes of the target's vector registers: slots per scores tile
VALUE_CHUNKS = (8, 4, 2, 1)  # vectors of the head dimension a values tile accumulates; the widest first


def _vector_at(builder, base, index, vec):
    """A pointer to the vector at float ``index`` of ``base`` (a float pointer)."""
    return builder.bitcast(builder.gep(base, [index]), vec.as_pointer())


def _sum_across(builder, sums: list) -> ir.Value:
    """One vector whose lane s is the sum of the lanes of ``sums[s]``: pairs of vectors folded in halves, level by
    level, so that after each level a vector holds twice the sources, each in half the lanes (in order)."""
    i32, width = ir.IntType(32), LANES  # width: lanes each source takes in a vector
    while width > 1:
        half, sources = width // 2, LANES // width
        low = [s * width + i for s in range(sources) for i in range(half)]
        high = [s * width + half + i for s in range(sources) for i in range(half)]
        first = ir.Constant(ir.VectorType(i32, LANES), low + [LANES + i for i in low])
        second = ir.Constant(ir.VectorType(i32, LANES), high + [LANES + i for i in high])
        sums = [builder.fadd(builder.shuffle_vector(u, v, first), builder.shuffle_vector(u, v, second))
                for u, v in zip(sums[::2], sums[1::2], strict=True)]
        width = half
    return sums[0]


@intrinsic
def scores_tile(typingctx, q, k, stride, chunks, n, out):
    """``scores_tile(q, k, stride, chunks, n, out)``: ``out[s] = sum_d q[d] * k_s[d]`` for s < ``LANES``, over
    ``chunks`` vectors of the head dimension, where slot s's key is at ``k + min(s, n - 1) * stride`` (slots from
    ``n`` on repeat the last one: their lanes are written, and the caller ignores them). ``out`` takes ``LANES``
    floats."""
    sig = types.void(*[types.int64] * 6)

    def codegen(context, builder, signature, args):
        q_addr, k_addr, stride, chunks, n, out_addr = args
        f32, one = ir.FloatType(), ir.Constant(I64, 1)
        vec, fma_v = ir.VectorType(f32, LANES), fma(builder, LANES)
        last = builder.sub(n, one)
        keys = []
        for s in range(LANES):
            slot = builder.select(builder.icmp_signed("<", ir.Constant(I64, s), n), ir.Constant(I64, s), last)
            keys.append(builder.inttoptr(builder.add(k_addr, builder.mul(slot, stride)), f32.as_pointer()))
        q0 = builder.inttoptr(q_addr, f32.as_pointer())
        # one vector of the head dimension a trip: the query's, times each slot's key
        loop = CountedLoop(builder, chunks, "scores", [ir.Constant(vec, [0.0] * LANES)] * LANES)
        at = builder.mul(loop.index, ir.Constant(I64, LANES))
        qv = builder.load(_vector_at(builder, q0, at, vec), align=4)
        sums = loop.close([builder.call(fma_v, [qv, builder.load(_vector_at(builder, key, at, vec), align=4), a])
                           for key, a in zip(keys, loop.carried, strict=True)])
        total = _sum_across(builder, sums)
        builder.store(total, builder.inttoptr(out_addr, vec.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _values_tile(chunks: int):
    """An intrinsic ``(p, v, stride, slots, out)``: ``out[:chunks * LANES] += sum_n p[n] * v_n`` over ``slots``
    slots, slot n's values at ``v + n * stride``, each slot added in turn (the order of a plain loop)."""

    @intrinsic
    def tile(typingctx, p, v, stride, slots, out):
        sig = types.void(*[types.int64] * 5)

        def codegen(context, builder, signature, args):
            p_addr, v_addr, stride, slots, out_addr = args
            f32 = ir.FloatType()
            vec, fma_v = ir.VectorType(f32, LANES), fma(builder, LANES)
            out0, p0 = builder.inttoptr(out_addr, f32.as_pointer()), builder.inttoptr(p_addr, f32.as_pointer())
            dests = [_vector_at(builder, out0, ir.Constant(I64, c * LANES), vec) for c in range(chunks)]
            loop = CountedLoop(builder, slots, "values", [builder.load(d, align=4) for d in dests])
            # one slot a trip: its weight broadcast, times its values
            weight = splat(builder, builder.load(builder.gep(p0, [loop.index])), LANES)
            row = builder.inttoptr(builder.add(v_addr, builder.mul(loop.index, stride)), f32.as_pointer())
            totals = loop.close([builder.call(fma_v, [weight, builder.load(
                _vector_at(builder, row, ir.Constant(I64, c * LANES), vec), align=4), a])
                for c, a in enumerate(loop.carried)])
            for total, d in zip(totals, dests, strict=True):
                builder.store(total, d, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


values_8, values_4, values_2, values_1 = (_values_tile(c) for c in VALUE_CHUNKS)
