"""Dense matmuls over weights kept quantized (issue 41), as a hand-written CPU kernel: an XLA FFI custom call
compiled by numba (``quantized_dense_kernel``) that reads a weight's integers from panels and converts them to
floats in registers, so that a decode step streams 1/4 (8-bit) or about 1/6 (4-bit) of the float32 weight's bytes.

The panels of a quantized weight w [K, N] (K contracted; N a multiple of PANEL), every layer's stacked [L, ...]:
- ``q``: [L, N / 32, K, 32] int8 for the 8-bit formats (INT8, Q8_0); [L, N / 32, K / 2, 32] uint8 for the 4-bit
  ones (Q4_0, Q4_1), two nibbles a byte along K in GGUF's order: in each block of 32 k's, byte j holds k = j in its
  low half and k = j + 16 in its high half;
- ``scale``: [L, N / 32, K / B, 32] float32, B the format's block along K (32; K for INT8, a scale per column);
- ``offset``: Q4_1's, like ``scale``.
``to_panels`` makes them from a ``quantized.Quantized`` weight [*lead, K, N] (its blocked axis K).

Like ``dense`` the kernel is built by numba once per host (cached on disk): before the first step of a stage that
waits for its kernels, else in the background (``select.QUANTIZED_KERNEL``), XLA's formulation running meanwhile
(``reference``: the layer's weight dequantized, then a dot); where numba cannot build it, a warning says so and
that formulation stays.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.runner import quantized
from pipejax.runner.cpu.build import build_and_register
from pipejax.runner.cpu.dense import ADD, GATED, PLAIN
from pipejax.runner.panels import PANEL, swiglu

KERNEL = "pipejax.runner.cpu.quantized_dense_kernel"  # the numba module that builds the handler
TARGET = "pipejax_quantized_panel_matmul"
BLOCK = 32  # the kernel's K is a multiple of it (whole blocks of 32 k's: GGUF's blocks, the kernel's pass)

# The code the kernel runs for a format (its int32 kind operand): INT8 and Q8_0 differ only in their scale blocks.
KIND_8BIT, KIND_Q4_0, KIND_Q4_1 = 0, 1, 2
KINDS = {quantized.INT8.name: KIND_8BIT, quantized.Q8_0.name: KIND_8BIT, quantized.Q4_0.name: KIND_Q4_0,
         quantized.Q4_1.name: KIND_Q4_1}

__all__ = ["ADD", "GATED", "PLAIN", "matmul", "prepare", "reference", "to_panels"]


@functools.cache
def _handler() -> Any:
    """Build and register the handler once (it lives as long as the process); None (with a warning) where numba
    cannot build it."""
    return build_and_register(TARGET, KERNEL, "quantized dense-matmul", "XLA's dot over the dequantized weight")


def prepare() -> bool:
    """Build (or load from numba's cache) the kernel now; whether it is available."""
    return _handler() is not None


def _check(x, q, scale, offset, fmt: quantized.Format) -> tuple[int, int]:
    """(K, N) of a call, after checking the panels' shapes and dtypes against x and ``fmt``."""
    if fmt.name not in KINDS:
        raise ValueError(f"no quantized dense kernel for the format {fmt.name}")
    if q.ndim != 4 or q.shape[3] != PANEL or scale.ndim != 4 or scale.shape[3] != PANEL:
        raise ValueError(f"quantized panels are [L, N / {PANEL}, K', {PANEL}]: q {q.shape}, scale {scale.shape}")
    k = x.shape[1]
    if q.shape[2] * (8 // fmt.bits) != k or q.dtype != fmt.dtype:
        raise ValueError(f"{fmt.name} panels of K = {k} are {fmt.dtype} [L, P, {k * fmt.bits // 8}, {PANEL}], "
                         f"not {q.dtype} {q.shape}")
    blocks = k // fmt.block_of(k)
    if scale.shape != (*q.shape[:2], blocks, PANEL):
        raise ValueError(f"{fmt.name} scales of K = {k} are [L, P, {blocks}, {PANEL}], not {scale.shape}")
    if fmt.offset != (offset is not None) or (offset is not None and offset.shape != scale.shape):
        raise ValueError(f"{fmt.name} takes {'an offset like its scale' if fmt.offset else 'no offset'}")
    return k, q.shape[1] * PANEL


def reference(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None, fmt: quantized.Format,
              layer: jax.Array | int = 0, gated: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """XLA's formulation of ``matmul``: layer ``layer``'s weight dequantized (``quantized.dequantize``), then a dot
    (where numba is missing, and the tests' second opinion)."""
    w = quantized.Quantized(q[layer], scale[layer], None if offset is None else offset[layer], fmt, -2)
    n = q.shape[1] * PANEL
    y = jnp.einsum("mk,pkc->mpc", x, quantized.dequantize(w, x.dtype)).reshape(x.shape[0], n)
    y = swiglu(y[:, : n // 2], y[:, n // 2:]) if gated else y
    return y if residual is None else residual + y


def matmul(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None, fmt: quantized.Format,
           layer: jax.Array | int = 0, gated: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ layer ``layer`` of a quantized weight in panels (see the module's docstring) -> [M, N] float32;
    the whole stack goes in with a scalar ``layer``, as ``dense.matmul``'s. ``gated``: the first half of the panels
    a gate, the second its up projection, and the result silu(gate) * up [M, N / 2]. ``residual`` [M, N]: the
    result is residual + x @ w, the kernel adding each finished output tile to the residual in place. ``fmt``'s
    block may be any divisor of K (int8's scales per head of the attention output: blocks of D); one that is not a
    multiple of 32 (the kernel's pass), x not float32, or no numba: ``reference`` instead."""
    k, n = _check(x, q, scale, offset, fmt)
    if gated and residual is not None:
        raise ValueError("a gated matmul takes no residual")
    if gated and n % (2 * PANEL):
        raise ValueError(f"a gated matmul's N ({n}) is two halves of whole panels")
    if (k // scale.shape[2]) % BLOCK or _handler() is None or x.dtype != jnp.float32:
        return reference(x, q, scale, offset, fmt, layer, gated, residual)
    operands = (x, q, scale, scale if offset is None else offset, jnp.asarray(layer, jnp.int32))
    kind = jnp.int32(KINDS[fmt.name])
    if residual is not None:
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(residual.shape, jnp.float32), input_output_aliases={7: 0})
        return call(*operands, jnp.int32(ADD), kind, residual.astype(jnp.float32))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n // 2 if gated else n), jnp.float32))
    return call(*operands, jnp.int32(GATED if gated else PLAIN), kind)


def to_panels(w: quantized.Quantized) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A quantized weight [*lead, K, N] (blocked along K: ``axis`` -2) as its panels (q, scale, offset or None),
    each [*lead, N / 32, K', 32] (numpy): what the loader writes."""
    if w.axis != -2:
        raise ValueError(f"the panels' weight is blocked along its contracted axis (-2), not {w.axis}")

    def panels(a):
        a = np.asarray(a)
        *lead, rows, n = a.shape
        return np.ascontiguousarray(np.moveaxis(a.reshape(*lead, rows, n // PANEL, PANEL), -2, -3))

    return panels(w.q), panels(w.scale), None if w.offset is None else panels(w.offset)
