"""The CPU dense kernel over weights kept quantized (``cpu.quantized_dense``, issue 41) and its XLA formulation,
against numpy's float64 product with the dequantized weight, for every format: INT8, Q8_0, Q4_0, Q4_1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax.runner import quantized
from pipejax.runner.cpu import quantized_dense as qd
from pipejax.runner.panels import PANEL

FORMATS = [quantized.INT8, quantized.Q8_0, quantized.Q4_0, quantized.Q4_1]
RTOL = 1e-5  # of the largest magnitude the sum could reach (see ``_check``)


def _weight(fmt: quantized.Format, k: int, n: int, rng: np.random.Generator, layers: int = 0) -> quantized.Quantized:
    """A random weight [*layers, K, N] in ``fmt`` with its extremes in it: integers -128/-127/127 (8-bit) or
    nibbles 0 and 15 in whole rows and columns, a block of scale 0, negative scales, Q4_1's offsets of both signs."""
    lead = (layers,) if layers else ()
    blocks = k // fmt.block_of(k)
    if fmt.bits == 8:
        q = rng.integers(-128, 128, (*lead, k, n)).astype(np.int8)
        q[..., 0, :], q[..., 1, :], q[..., :, 2], q[..., 3, 5:9] = -127, 127, -128, 127
    else:
        q = rng.integers(0, 16, (*lead, k, n)).astype(np.uint8)
        q[..., 0, :], q[..., 17, :], q[..., :, 2], q[..., :, 3] = 0, 15, 15, 0
        q = quantized.pack_nibbles(q, -2)
    scale = rng.standard_normal((*lead, blocks, n)).astype(np.float32)
    scale[..., -1, : n // 2] = 0  # a block of zero scales (and, for INT8, half the columns)
    offset = rng.standard_normal(scale.shape).astype(np.float32) if fmt.offset else None
    return quantized.Quantized(q, scale, offset, fmt, -2)


def _stacked(w: quantized.Quantized):
    """``to_panels`` of a weight, with a layer axis of 1 where it has none (the kernel takes a stack)."""
    q, scale, offset = qd.to_panels(w)
    if q.ndim == 3:
        q, scale, offset = q[None], scale[None], None if offset is None else offset[None]
    return jnp.asarray(q), jnp.asarray(scale), None if offset is None else jnp.asarray(offset)


def _dense64(w: quantized.Quantized) -> tuple[np.ndarray, np.ndarray]:
    """The dequantized weight in float64, and the largest magnitude each of its elements' terms can reach in the
    kernel: |scale| x the format's largest integer (+ |offset|): an error bound's scale."""
    dense = np.asarray(quantized.dequantize(w, np.float32, np), np.float64)
    top = 128 if w.fmt.bits == 8 else 15
    per_block = np.abs(np.asarray(w.scale, np.float64)) * top
    if w.offset is not None:
        per_block = per_block + np.abs(w.offset)
    k = dense.shape[-2]
    return dense, np.repeat(per_block, k // per_block.shape[-2], axis=-2)


def _check(got, x, w: quantized.Quantized, err_msg=""):
    """got == x @ dequantize(w) within RTOL of |x| @ the largest magnitudes (a float32 sum's error scale)."""
    dense, magnitude = _dense64(w)
    x64 = np.asarray(x, np.float64)
    want, bound = x64 @ dense, np.abs(x64) @ magnitude
    got = np.asarray(got)
    assert got.shape == want.shape, err_msg
    excess = np.abs(got - want) - RTOL * bound
    assert np.all(excess <= 0), f"{err_msg}: worst {np.abs(got - want).flat[excess.argmax()]:.3g} over a bound of " \
                                f"{(RTOL * bound).flat[excess.argmax()]:.3g}"


@functools.cache
def _jitted(fn, **kwargs):
    return jax.jit(functools.partial(fn, **kwargs), static_argnames="fmt")


def test_kernel_is_built():
    """numba builds the kernel here: the tests below run it, not the XLA formulation."""
    assert qd.prepare()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("k,n", [(64, 64), (64, 192), (576, 64), (576, 192)])
def test_kernel_matches_numpy(fmt, k, n):
    """Rows 1, 3, 8, 13 (the register tiles of 8, 4, 2, 1 rows; 13 = 8 + 4 + 1), 21 (8-bit: 8 + 8 + 4 + 1) and
    64 (chunks dequantized for the float32 tiles: with AVX-512 from 32 rows on for 8-bit formats, 16 for 4-bit; the
    4-bit formats' 21 rows too); one panel's columns or several; one block or 18 along K (INT8: one scale over all
    of K). The XLA formulation (``reference``) too."""
    rng = np.random.default_rng(k + n + fmt.bits)
    w = _weight(fmt, k, n, rng)
    q, scale, offset = _stacked(w)
    for m in (1, 3, 8, 13, 21, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :3] = [1e3, -1e3, 0]
        _check(_jitted(qd.matmul)(x, q, scale, offset, fmt=fmt), x, w, f"{fmt.name} rows {m}")
        if m in (3, 64):
            _check(_jitted(qd.reference)(x, q, scale, offset, fmt=fmt), x, w, f"reference, {fmt.name} rows {m}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_layer_of_a_stack(fmt):
    """The whole stack [L, ...] goes in with the layer a traced scalar, as a layer scan calls it."""
    rng = np.random.default_rng(7)
    ws = _weight(fmt, 96, 64, rng, layers=3)
    q, scale, offset = _stacked(ws)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    for layer in range(3):
        w = quantized.Quantized(ws.q[layer], ws.scale[layer], None if ws.offset is None else ws.offset[layer], fmt, -2)
        for fn in (qd.matmul, qd.reference):
            got = _jitted(fn)(x, q, scale, offset, fmt=fmt, layer=np.int32(layer))
            _check(got, x, w, f"{fn.__name__}, layer {layer}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 5, 130])
def test_gated_silu_and_multiply(fmt, m):
    """An MLP's gate_up (the first half of the panels the gate, the second the up projection): silu(gate) * up
    out of the kernel, in blocks of GLU_ROWS rows (130 rows take two)."""
    rng = np.random.default_rng(m)
    w = _weight(fmt, 64, 192, rng)
    q, scale, offset = _stacked(w)
    x = rng.standard_normal((m, 64)).astype(np.float32) * np.float32(0.1)
    dense, magnitude = _dense64(w)
    y, bound = x.astype(np.float64) @ dense, np.abs(x.astype(np.float64)) @ magnitude
    gate, up = y[:, :96], y[:, 96:]
    want = gate / (1 + np.exp(-gate)) * up
    tolerance = RTOL * (1.1 * bound[:, :96] * np.abs(up) + np.abs(gate) * bound[:, 96:]) + 1e-6 * np.abs(want)
    for fn in (qd.matmul, qd.reference):
        got = np.asarray(_jitted(fn, gated=True)(x, q, scale, offset, fmt=fmt))
        assert got.shape == (m, 96)
        assert np.all(np.abs(got - want) <= tolerance), fn.__name__


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [3, 21, 130])
def test_residual_added_in_place(fmt, m):
    """residual + x @ w: the kernel adds each finished output tile to the residual (its own buffer), so the result
    is bit for bit the product plus the residual, as XLA's add after the dot would give; a residual still used
    after the call is left as it was."""
    rng = np.random.default_rng(m)
    w = _weight(fmt, 576, 64, rng)
    q, scale, offset = _stacked(w)
    x = rng.standard_normal((m, 576)).astype(np.float32)
    residual = jnp.asarray(rng.standard_normal((m, 64)).astype(np.float32))

    @jax.jit
    def step(x, residual):
        product = qd.matmul(x, q, scale, offset, fmt)
        return qd.matmul(x, q, scale, offset, fmt, residual=residual), product, residual * 1.0

    got, product, kept = (np.asarray(a) for a in step(x, residual))
    np.testing.assert_array_equal(got, np.asarray(residual) + product)
    np.testing.assert_array_equal(kept, np.asarray(residual))
    _check(got - np.asarray(residual), x, w)
    reference = _jitted(qd.reference)(x, q, scale, offset, fmt=fmt, residual=residual)
    _check(np.asarray(reference) - np.asarray(residual), x, w, "reference")


@pytest.mark.parametrize("k,block", [(40, 0), (192, 64), (192, 48)])
def test_int8_blocks_of_any_size(k, block):
    """INT8 scales in blocks of any divisor of K (the runner's per-head scales of the attention output: blocks of
    D): a block of whole 32s runs the kernel (64: two 32 k passes a block), another (K = 40 with one block, 48)
    ``reference``."""
    import dataclasses

    fmt = dataclasses.replace(quantized.INT8, block=block)
    rng = np.random.default_rng(k + block)
    w = _weight(fmt, k, 64, rng)
    for m in (3, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        _check(_jitted(qd.matmul)(x, *_stacked(w), fmt=fmt), x, w, f"rows {m}")


def test_to_panels_is_the_loaders_layout():
    """Element [l, p, k, c] of the integers is w[l, k, p * 32 + c]'s; for 4-bit formats byte [l, p, kb * 16 + j, c]
    holds k = kb * 32 + j in its low nibble and k = kb * 32 + j + 16 in its high one; the scales [l, p, block, c]."""
    rng = np.random.default_rng(0)
    w8 = _weight(quantized.Q8_0, 64, 96, rng, layers=2)
    q, scale, _ = qd.to_panels(w8)
    assert q.shape == (2, 3, 64, PANEL) and scale.shape == (2, 3, 2, PANEL)
    assert q[1, 2, 40, 5] == w8.q[1, 40, 2 * PANEL + 5] and scale[1, 2, 1, 5] == w8.scale[1, 1, 2 * PANEL + 5]
    w4 = _weight(quantized.Q4_1, 64, 96, rng)
    q, scale, offset = qd.to_panels(w4)
    nibbles = quantized.unpack_nibbles(np.asarray(w4.q), -2, np)  # [K, N]
    assert q.shape == (3, 32, PANEL) and offset.shape == (3, 2, PANEL)
    byte = q[1, 16 + 3, 7]  # kb = 1, j = 3 of panel 1, column 7
    assert byte & 15 == nibbles[32 + 3, PANEL + 7] and byte >> 4 == nibbles[32 + 19, PANEL + 7]
    assert offset[1, 1, 7] == w4.offset[1, PANEL + 7]


def test_bad_operands_are_refused():
    rng = np.random.default_rng(0)
    q, scale, offset = _stacked(_weight(quantized.Q4_1, 64, 64, rng))
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="takes an offset"):
        qd.matmul(x, q, scale, None, quantized.Q4_1)
    with pytest.raises(ValueError, match="q4_0 panels of K = 128"):
        qd.matmul(jnp.ones((2, 128), jnp.float32), q, scale, None, quantized.Q4_0)
    with pytest.raises(ValueError, match="gated matmul takes no residual"):
        qd.matmul(x, q, scale, offset, quantized.Q4_1, gated=True, residual=jnp.ones((2, 64)))
    with pytest.raises(ValueError, match="q8_0 scales of K = 64"):
        qd.matmul(x, jnp.zeros((1, 2, 64, PANEL), jnp.int8), scale[:, :, :1], None, quantized.Q8_0)


AVX2_CHECK = """
import numpy as np, jax.numpy as jnp
from pipejax.runner import quantized
from pipejax.runner.cpu import quantized_dense as qd, quantized_dense_kernel
assert quantized_dense_kernel.LANES == 8, quantized_dense_kernel.LANES
rng = np.random.default_rng(0)
for fmt in (quantized.INT8, quantized.Q8_0, quantized.Q4_0, quantized.Q4_1):
    blocks = 96 // fmt.block_of(96)
    if fmt.bits == 8:
        q = rng.integers(-127, 128, (96, 128)).astype(np.int8)
    else:
        q = quantized.pack_nibbles(rng.integers(0, 16, (96, 128)), -2)
    scale = rng.standard_normal((blocks, 128)).astype(np.float32)
    offset = rng.standard_normal((blocks, 128)).astype(np.float32) if fmt.offset else None
    w = quantized.Quantized(q, scale, offset, fmt, -2)
    panels = [None if a is None else jnp.asarray(a[None]) for a in qd.to_panels(w)]
    dense = np.asarray(quantized.dequantize(w, np.float32, np), np.float64)
    magnitude = np.abs(scale.astype(np.float64)) * (128 if fmt.bits == 8 else 15)
    magnitude += 0 if offset is None else np.abs(offset)
    magnitude = np.repeat(magnitude, 96 // blocks, axis=0)
    for rows in (1, 2, 3, 5, 17):
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        y, tol = x.astype(np.float64) @ dense, 1e-5 * (np.abs(x.astype(np.float64)) @ magnitude)
        assert np.all(np.abs(np.asarray(qd.matmul(x, *panels, fmt)) - y) <= tol), (fmt.name, rows)
        res = rng.standard_normal((rows, 128)).astype(np.float32)
        got = np.asarray(qd.matmul(x, *panels, fmt, residual=jnp.asarray(res)))
        assert np.all(np.abs(got - res - y) <= tol + 1e-6 * np.abs(res)), (fmt.name, rows)
        gate, up = y[:, :64], y[:, 64:]
        want = gate / (1 + np.exp(-gate)) * up
        got = np.asarray(qd.matmul(x, *panels, fmt, gated=True))
        assert np.all(np.abs(got - want) <= 1.1 * tol[:, :64] * np.abs(up) + np.abs(gate) * tol[:, 64:]
                      + 1e-6 * np.abs(want)), (fmt.name, rows)
assert qd.prepare()
print("ok")
"""


def test_the_avx2_tiles_match_numpy():
    """Compiled for an AVX2 target (numba's ``NUMBA_CPU_NAME=haswell``, which this host runs whatever its own ISA),
    the kernel takes the AVX2 tiles (2 and 1 rows x 4 registers of 8 lanes, one k an iteration) and still matches
    numpy in every mode (numba caches it next to the host's build: another CPU name, another cache entry)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CPU_NAME": "haswell"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
