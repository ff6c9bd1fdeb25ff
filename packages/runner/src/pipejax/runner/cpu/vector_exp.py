"""A float32 exp that LLVM vectorizes, for the CPU kernels' softmax and SiLU (numba code; imported only where a
kernel is built). A call to libm's ``expf`` per element keeps a loop scalar: 2.6 ns an element on this CPU,
against about 0.4 for the polynomial here.

A note for loops in these kernels: numba checks every array index for a negative (wrapping) value unless it can
see that the index is not one, and that check keeps LLVM's vectorizer off. A loop ``for c in range(lo, hi)`` over
``a[c]`` keeps it; the same loop over ``a[lo:hi][c]`` for ``c in range(hi - lo)`` does not.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_LOG2E, _LN2_HI, _LN2_LO = 1.44269504, 0.693359375, -2.12194440e-4
# exp(r) on [-ln2 / 2, ln2 / 2], Cephes' expf polynomial (relative error below float32's epsilon); float32 constants,
# so that numba evaluates it in float32 (Python floats made it float64, converting every element)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                          1.6666665459e-1, 5.0000001201e-1))


@intrinsic
def _as_float(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _bits_of(typingctx, x):
    """The int32 bits of the float32 ``x``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def exp_f32(x):
    """exp(x) for a float32 ``x``, clamped to [-87, 88] (float32's normal range): a polynomial for the mantissa,
    2^n added to its exponent bits (relative error below 3e-7 against numpy's, test_cpu_vector_exp)."""
    c0, c1, c2, c3, c4, c5 = _EXP_POLY
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(_LOG2E) + np.float32(0.5))  # a float32: math.floor gives an int64
    r = x - n * np.float32(_LN2_HI) - n * np.float32(_LN2_LO)
    p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    return _as_float(_bits_of(p * r * r + r + np.float32(1.0)) + (np.int32(n) << 23))


@numba.njit(fastmath=True, error_model="numpy")
def softmax_numerators(row, lo, hi):
    """``row[lo:hi] = exp(row[lo:hi] - max(row[lo:hi]))`` and their sum (the softmax's denominator), in loops that
    LLVM vectorizes."""
    seg = row[lo:hi]  # indexed from 0 (see the module's note)
    top = seg[0]
    for c in range(1, seg.shape[0]):
        top = max(top, seg[c])
    total = np.float32(0.0)
    for c in range(seg.shape[0]):
        e = exp_f32(seg[c] - top)
        seg[c] = e
        total += e
    return total
