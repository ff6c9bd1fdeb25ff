"""The CPU dense-matmul kernel (an XLA FFI custom call compiled by numba) and ``panels.dense`` over weights in
panels, against numpy's matmul of the same weight in its own layout."""

import functools

import jax
import numpy as np
import pytest

from pipejax.runner.cpu import dense as cpu_dense
from pipejax.runner.panels import PANEL, Panels, dense


def _in_panels(w: np.ndarray, contracted: int) -> np.ndarray:
    """w [*in, *out] as panels [*out[:-1], out[-1] / PANEL, *in, PANEL] (what the loader writes)."""
    ins, outs = w.shape[:contracted], w.shape[contracted:]
    split = w.reshape(*ins, *outs[:-1], outs[-1] // PANEL, PANEL)
    n_out = len(outs)
    order = (*range(contracted, contracted + n_out), *range(contracted), contracted + n_out)
    return np.ascontiguousarray(split.transpose(order))


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13, 64])
@pytest.mark.parametrize("ins,outs", [((48,), (32,)), ((100,), (3, 2, 64)), ((4, 16), (96,))])
def test_kernel_and_xla_over_panels_match_numpy(rows, ins, outs):
    """Every row tiling (8, 4, 2, 1), one or many panels, several output dims, two contracted dims."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, *ins), np.float32)
    w = rng.standard_normal((*ins, *outs), np.float32)
    want = np.tensordot(x.astype(np.float64), w.astype(np.float64), len(ins))
    panels = Panels(jax.numpy.asarray(_in_panels(w, len(ins))))
    step = jax.jit(dense, static_argnums=(2, 3))
    for kernel in (cpu_dense.matmul, None):
        got = np.asarray(step(x, panels, len(ins), kernel))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"kernel={kernel}")
    np.testing.assert_allclose(np.asarray(step(x, jax.numpy.asarray(w), len(ins), None)), want, rtol=1e-4, atol=1e-4)


def test_rows_past_one_block_of_x():
    """An x larger than ``X_BLOCK`` goes through the panels a block of rows at a time (three equal blocks, the
    last 7 rows short of whole tiles), plain and added to a residual, match numpy."""
    from pipejax.runner.cpu import dense_kernel

    kc = 2048
    most = dense_kernel.X_BLOCK // (kc * 4) // dense_kernel.ROW_TILES[0] * dense_kernel.ROW_TILES[0]
    rows = 2 * most + 7
    block = dense_kernel._block_rows(rows, kc)
    assert block * kc * 4 <= dense_kernel.X_BLOCK < rows * kc * 4 and -(-rows // block) == 3
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, kc), np.float32)
    w = rng.standard_normal((kc, 2 * PANEL), np.float32)
    residual = rng.standard_normal((rows, 2 * PANEL), np.float32)
    panels = jax.numpy.asarray(_in_panels(w, 1))[None]
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(cpu_dense.matmul(x, panels)), want, rtol=1e-4, atol=1e-3)
    added = cpu_dense.matmul(x, panels, residual=jax.numpy.asarray(residual))
    np.testing.assert_allclose(np.asarray(added), residual + want, rtol=1e-4, atol=1e-3)


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    from pipejax.runner.cpu import isa

    for index, size in enumerate(("32K", "512K", "16384K", "garbage")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert isa.last_level_cache_bytes(str(tmp_path)) == 16 << 20
    assert isa.last_level_cache_bytes(str(tmp_path / "none"), default=123) == 123


@pytest.mark.parametrize("rows", [5, 64])
def test_a_layer_of_stacked_panels(rows):
    """A layer scan hands the kernel every layer's panels and the layer's index (a traced scalar), not a slice."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 40), np.float32)
    ws = rng.standard_normal((3, 40, 2, 64), np.float32)
    stack = jax.numpy.asarray(np.stack([_in_panels(w, 1) for w in ws]))  # [L, 2, 2, 40, PANEL]
    step = jax.jit(lambda x, i, kernel: dense(x, Panels(stack, i), 1, kernel), static_argnums=2)
    for layer, w in enumerate(ws):
        want = np.tensordot(x.astype(np.float64), w.astype(np.float64), 1)
        for kernel in (cpu_dense.matmul, None):
            got = np.asarray(step(x, np.int32(layer), kernel))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"layer {layer}, kernel={kernel}")


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_gated_silu_and_multiply(rows):
    """An MLP's gate_up [in, 2, F]: silu(gate) * up straight from the kernel (row blocks of GLU_ROWS: 130 rows
    take two), and from XLA's dot over panels and over the weight's own layout, against numpy."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 40), np.float32)
    ws = rng.standard_normal((2, 40, 2, 96), np.float32)
    stack = jax.numpy.asarray(np.stack([_in_panels(w, 1) for w in ws]))
    step = jax.jit(lambda x, i, kernel: dense(x, Panels(stack, i), 1, kernel, gated=True), static_argnums=2)
    for layer, w in enumerate(ws):
        y = np.tensordot(x.astype(np.float64), w.astype(np.float64), 1)
        want = y[:, 0] / (1 + np.exp(-y[:, 0])) * y[:, 1]
        for kernel in (cpu_dense.matmul, None):
            got = np.asarray(step(x, np.int32(layer), kernel))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"layer {layer}, kernel={kernel}")
        plain = jax.jit(lambda x, w: dense(x, w, 1, None, gated=True))(x, jax.numpy.asarray(w))
        np.testing.assert_allclose(np.asarray(plain), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 64])
def test_residual_added_in_place(rows):
    """residual + x @ w (a decoder layer's o and down projections): the kernel adds each finished tile to the
    residual, so the result is bit for bit the product plus the residual, as XLA's add after the dot would give;
    two contracted dims, as o has; a residual still used after the call is left as it was."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 4, 16), np.float32)
    ws = rng.standard_normal((2, 4, 16, 96), np.float32)
    residual = jax.numpy.asarray(rng.standard_normal((rows, 96), np.float32))
    stack = jax.numpy.asarray(np.stack([_in_panels(w, 2) for w in ws]))

    @functools.partial(jax.jit, static_argnums=2)
    def step(x, i, kernel):
        product = dense(x, Panels(stack, i), 2, kernel)
        return dense(x, Panels(stack, i), 2, kernel, residual=residual), product, residual * 1.0

    for layer, w in enumerate(ws):
        want = np.asarray(residual, np.float64) + np.tensordot(x.astype(np.float64), w.astype(np.float64), 2)
        for kernel in (cpu_dense.matmul, None):
            got, product, kept = (np.asarray(a) for a in step(x, np.int32(layer), kernel))
            np.testing.assert_array_equal(got, np.asarray(residual) + product, err_msg=f"kernel={kernel}")
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"layer {layer}, kernel={kernel}")
            np.testing.assert_array_equal(kept, np.asarray(residual))
    with pytest.raises(ValueError, match="gated matmul takes no residual"):
        cpu_dense.matmul(x.reshape(rows, -1), stack.reshape(2, 3, 64, PANEL), 0, True, residual)


@pytest.mark.parametrize("rows,kc", [(1, 40), (13, 40), (64, 768), (520, 512)])
@pytest.mark.parametrize("gated", [False, True])
def test_x_rms_normed_as_the_kernel_reads_it(rows, kc, gated):
    """``model.project`` with a norm: the kernel norms x itself (``NORMED``; 520 x 512 past
    ``NORM_PARALLEL_FLOATS``, over numba's threads where the handler is parallel), XLA's formulation norms it first;
    both match numpy's norm and matmul, plain and gated (a layer's qkv and gate_up)."""
    from pipejax.runner.cpu import dense_kernel
    from pipejax.runner.model import NO_KERNELS, Kernels, project

    assert (rows * kc >= dense_kernel.NORM_PARALLEL_FLOATS) == (rows == 520)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, kc), np.float32) * 3
    scale = rng.standard_normal(kc, np.float32)
    w = rng.standard_normal((kc, 2, 64), np.float32)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * scale
    y = np.tensordot(normed, w.astype(np.float64), 1)
    want = y[:, 0] / (1 + np.exp(-y[:, 0])) * y[:, 1] if gated else y
    panels = Panels(jax.numpy.asarray(_in_panels(w, 1)))
    for kernels in (Kernels(dense=cpu_dense.matmul), NO_KERNELS):
        step = jax.jit(lambda x, s, kernels=kernels: project(x, panels, 1, kernels, norm=(s, 1e-5), gated=gated))
        got = np.asarray(step(x, scale))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3, err_msg=f"kernels={kernels}")
    with pytest.raises(ValueError, match="only a dense kernel over weights in panels norms x or rotates heads itself"):
        dense(x, jax.numpy.asarray(w), 1, None, norm=(scale, 1e-5))


AMX = pytest.mark.skipif(not cpu_dense.amx_ready(), reason="no AMX bf16 tiles on this CPU (or not granted)")


@AMX
@pytest.mark.parametrize("rows", [1, 17, 33, 300])
def test_amx_tiles_match_numpy_in_every_mode(rows):
    """On AMX's bf16 tiles (``amx_rows``; three bf16 pieces a value, six products): plain, gated and added to the
    residual, a layer of stacked panels, rows that are not whole blocks of 16 or pairs of them, and a row group
    boundary (300 rows: two groups of 256 with kc <= 1024), against numpy at the FMA kernel's tolerance; the
    results differ from the FMA tiles' (the calls did run on AMX); a contraction of no whole blocks of 32 and
    calls below ``amx_rows`` stay on the FMA tiles, bit for bit."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), np.float32)
    ws = rng.standard_normal((2, 96, 128), np.float32)
    stack = jax.numpy.asarray(np.stack([_in_panels(w, 1) for w in ws]))  # [L, 4, 96, PANEL]
    residual = jax.numpy.asarray(rng.standard_normal((rows, 128), np.float32))
    on_amx = functools.partial(cpu_dense.matmul, amx_rows=1)
    y = x.astype(np.float64) @ ws[1].astype(np.float64)
    cases = {"plain": ({}, y), "gated": ({"gated": True}, y[:, :64] / (1 + np.exp(-y[:, :64])) * y[:, 64:]),
             "added": ({"residual": residual}, np.asarray(residual, np.float64) + y)}
    for name, (how, want) in cases.items():
        got = np.asarray(jax.jit(functools.partial(on_amx, panels=stack, layer=1, **how))(x))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
        fma = np.asarray(jax.jit(functools.partial(cpu_dense.matmul, panels=stack, layer=1, **how))(x))
        assert not np.array_equal(got, fma), name
    above = np.asarray(jax.jit(lambda x: cpu_dense.matmul(x, stack, 1, amx_rows=rows + 1))(x))
    np.testing.assert_array_equal(above, np.asarray(jax.jit(lambda x: cpu_dense.matmul(x, stack, 1))(x)))
    x40, w40 = x[:, :40], jax.numpy.asarray(_in_panels(ws[0][:40], 1))[None]
    np.testing.assert_array_equal(np.asarray(on_amx(x40, w40)), np.asarray(cpu_dense.matmul(x40, w40)))


@AMX
@pytest.mark.parametrize("rows", [17, 300])
def test_kept_amx_tiles_give_the_split_ones_bits(rows):
    """A weight's tiles split once (``weight_tiles``) and kept: a call from ``kept_rows`` rows (below ``amx_rows``)
    reads them, in every mode and at every layer of a stack, with the same bits as the call that splits the
    weight itself; below ``kept_rows``, at ``amx_rows`` or more, or without tiles, the call does not read them."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), np.float32)
    stack = jax.numpy.asarray(np.stack([_in_panels(w, 1) for w in rng.standard_normal((3, 96, 128), np.float32)]))
    tiles = cpu_dense.weight_tiles(stack)
    assert tiles.shape == (3, 4, 3, 6 * 512) and tiles.dtype == np.uint16
    residual = jax.numpy.asarray(rng.standard_normal((rows, 128), np.float32))
    for how in ({}, {"gated": True}, {"residual": residual}):
        for layer in (0, 2):
            def call(layer=layer, how=how, **kw):
                fn = functools.partial(cpu_dense.matmul, panels=stack, layer=layer, **how, **kw)
                return np.asarray(jax.jit(fn)(x))

            split, fma = call(amx_rows=1), call()
            np.testing.assert_array_equal(call(kept_rows=rows, tiles=tiles), split, err_msg=str((how.keys(), layer)))
            np.testing.assert_array_equal(call(kept_rows=rows + 1, tiles=tiles), fma)
            np.testing.assert_array_equal(call(kept_rows=1, amx_rows=rows, tiles=tiles), split)
            np.testing.assert_array_equal(call(kept_rows=1), fma)
    flipped = np.asarray(tiles).copy()
    flipped[1] ^= 0x4000  # layer 1's tiles wrong: a call at layer 1 reads them (and not layer 0's or 2's)
    np.testing.assert_raises(AssertionError, np.testing.assert_array_equal,
                             np.asarray(cpu_dense.matmul(x, stack, 1, kept_rows=1, tiles=jax.numpy.asarray(flipped))),
                             np.asarray(cpu_dense.matmul(x, stack, 1, amx_rows=1)))


def test_kernel_is_built():
    """The kernel itself runs in the test above, not XLA's fallback: numba builds the handler here."""
    assert cpu_dense.prepare()



def test_the_runner_takes_the_kernel_on_one_cpu_device_only(tmp_path):
    """"auto": at tp = 1 whichever of the kernel (weights in panels) and XLA's dot measured faster here; XLA's dot
    and the weights' own layout at tp = 2 (where XLA's sharded dots run, and read panels slowly at a decode step's
    rows); "cpu-kernel" forces panels at tp = 1; asking for the kernel at tp = 2, or for a choice that does not
    exist, says what to do."""
    from hf_oracle import make_hf_checkpoint

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.config import CacheConfig
    from pipejax.runner.runner import StageRunner

    make_hf_checkpoint(tmp_path, "LlamaForCausalLM", max_position_embeddings=64)
    cache = CacheConfig(num_blocks=8)
    one, two = stage_mesh(jax.devices()[:1]), stage_mesh(jax.devices()[:2])
    runner = StageRunner(tmp_path, one, cache=cache)
    measured = runner.selection.measured["dense_matmuls"]
    assert runner.dense_matmuls == measured["choice"]
    assert isinstance(runner.params["layers.o"], Panels) == (measured["choice"] == "cpu-kernel")
    forced = StageRunner(tmp_path, one, cache=cache, dense_matmuls="cpu-kernel")
    assert forced.dense_matmuls == "cpu-kernel" and isinstance(forced.params["layers.o"], Panels)
    runner = StageRunner(tmp_path, two, cache=cache)
    assert runner.dense_matmuls == "xla" and not any(isinstance(w, Panels) for w in runner.params.values())
    assert StageRunner(tmp_path, one, cache=cache, dense_matmuls="xla").dense_matmuls == "xla"
    with pytest.raises(ValueError, match=r"dense_matmuls='cpu-kernel' needs the native model implementation, one "
                                         r"CPU device per stage \(tp = 1\), float32 and numba \(here: 2 cpu device"):
        StageRunner(tmp_path, two, cache=cache, dense_matmuls="cpu-kernel")
    with pytest.raises(ValueError, match="dense_matmuls='mkl'; use 'auto', 'xla' or 'cpu-kernel'"):
        StageRunner(tmp_path, one, cache=cache, dense_matmuls="mkl")


def test_calls_from_xla_rows_on_are_xlas_dot_over_the_panels():
    """``xla_rows``: a call of that many rows or more is XLA's dot over the panels (no kernel call in its program),
    a smaller one the kernel; both give numpy's product."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 4 * 32), np.float32)
    panels = jax.numpy.asarray(np.ascontiguousarray(w.reshape(40, 4, 32).transpose(1, 0, 2)))[None]
    for rows, kernel in ((3, True), (4, False), (9, False)):
        x = rng.standard_normal((rows, 40), np.float32)
        program = str(jax.make_jaxpr(lambda x: cpu_dense.matmul(x, panels, xla_rows=4))(x))
        assert ("ffi_call" in program) == kernel, program
        np.testing.assert_allclose(np.asarray(cpu_dense.matmul(x, panels, xla_rows=4)),
                                   x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)


AVX2_CHECK = """
import jax, numpy as np
from pipejax.runner.cpu import dense as cpu_dense, dense_kernel
tile = (dense_kernel.LANES, dense_kernel.GROUPS, dense_kernel.ROW_TILES)
assert tile == (8, 2, (6, 4, 2, 1)), tile
rng = np.random.default_rng(0)
for rows in (1, 2, 3, 5, 7, 11, 13, 64):
    x = rng.standard_normal((rows, 40), np.float32)
    w = rng.standard_normal((40, 4 * 32), np.float32)
    panels = jax.numpy.asarray(np.ascontiguousarray(w.reshape(40, 4, 32).transpose(1, 0, 2)))[None]
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(cpu_dense.matmul(x, panels)), want, rtol=1e-4, atol=1e-4)
    gate, up = want[:, :64], want[:, 64:]
    np.testing.assert_allclose(np.asarray(cpu_dense.matmul(x, panels, gated=True)), gate / (1 + np.exp(-gate)) * up,
                               rtol=1e-4, atol=1e-4)
    res = rng.standard_normal((rows, 128), np.float32)
    np.testing.assert_allclose(np.asarray(cpu_dense.matmul(x, panels, residual=jax.numpy.asarray(res))), res + want,
                               rtol=1e-4, atol=1e-4)
rows = 2 * (dense_kernel.X_BLOCK // 8192 // 6 * 6) + 7  # x's rows in three blocks (X_BLOCK), each packed
x, w = rng.standard_normal((rows, 2048), np.float32), rng.standard_normal((2048, 64), np.float32)
panels = jax.numpy.asarray(np.ascontiguousarray(w.reshape(2048, 2, 32).transpose(1, 0, 2)))[None]
np.testing.assert_allclose(np.asarray(cpu_dense.matmul(x, panels)), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)
assert cpu_dense.prepare()
print("ok")
"""


def test_the_avx2_tile_matches_numpy(tmp_path):
    """Compiled for an AVX2 target (numba's ``NUMBA_CPU_NAME=haswell``, which this host runs whatever its own ISA),
    the kernel takes the AVX2 tile (6 rows x 2 registers of 8 lanes, each panel in two column groups) and still
    matches numpy in every mode, at row counts that take each tile height."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _experts_in_panels(gate_up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L, E, X, 2, Fm] and [L, X, Fm, E] as ``cpu_dense.routed_experts`` reads them: [L X, 2 Fm / 32, E, 32] and
    [L X, E / 32, Fm, 32] (each expert's own panels)."""
    L, E, X, _, Fm = gate_up.shape
    gu = np.stack([_in_panels(gate_up[layer, :, e], 1) for layer in range(L) for e in range(X)])
    dn = np.stack([_in_panels(down[layer, e], 1) for layer in range(L) for e in range(X)])
    return gu.reshape(L * X, 2 * Fm // PANEL, E, PANEL), dn


@pytest.mark.parametrize("rows,k,routing", [(1, 2, "spread"), (3, 1, "spread"), (70, 4, "one expert"),
                                            (130, 2, "spread")])
def test_routed_experts(rows, k, routing):
    """A Mixture-of-Experts layer's routed experts, each on only its routed rows, added to the residual: against
    numpy's loop over the routes, for the second of two stacked layers (the kernel reads its experts at ``first``);
    experts with no route, one expert taking every token's first route (70 rows: several row tiles), and 130 rows
    (two blocks of the gated pass)."""
    rng = np.random.default_rng(rows)
    L, E, X, Fm = 2, 64, 8, 96
    gate_up = rng.standard_normal((L, E, X, 2, Fm), np.float32) * 0.2
    down = rng.standard_normal((L, X, Fm, E), np.float32) * 0.2
    gu, dn = (jax.numpy.asarray(a) for a in _experts_in_panels(gate_up, down))
    x = rng.standard_normal((rows, E), np.float32)
    chosen = np.stack([rng.choice(X, k, replace=False) for _ in range(rows)]).astype(np.int32)
    if routing == "one expert":
        chosen[:, 0] = 5
        chosen[:, 1:][chosen[:, 1:] == 5] = 6
    weights = rng.random((rows, k)).astype(np.float32)
    residual = rng.standard_normal((rows, E), np.float32)
    layer = 1
    want = residual.astype(np.float64)
    for t in range(rows):
        for j in range(k):
            h = x[t].astype(np.float64) @ gate_up[layer, :, chosen[t, j]].reshape(E, 2 * Fm)
            act = h[:Fm] / (1 + np.exp(-h[:Fm])) * h[Fm:]
            want[t] += weights[t, j] * (act @ down[layer, chosen[t, j]])
    got = jax.jit(cpu_dense.routed_experts)(x, gu, dn, layer * X, chosen, weights, residual)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kc", [1, 7, 48, 768, 2049])
@pytest.mark.parametrize("tiles", [1, 3, 8, 22, 64])
def test_the_next_panels_prefetch_is_shared_by_the_tiles_without_gap_or_overlap(kc, tiles):
    """Each row tile of a panel prefetches its part of the next panel (``dense_kernel._part``): together the tiles'
    parts cover the next panel's kc rows of 32 floats once each, in order, whatever kc and the number of tiles."""
    from pipejax.runner.cpu import dense_kernel

    ahead, share, row = 1 << 20, -(-kc // tiles), PANEL * 4
    covered = 0
    for t in range(tiles):
        start, rows = dense_kernel._part.py_func(ahead, share, t, kc)
        assert rows >= 0 and rows <= kc
        if rows:
            assert start == ahead + covered * row, (t, start, covered)
            covered += rows
    assert covered == kc


def test_amx_block_order_takes_each_piece_product_once_per_tile_pair():
    """``amx_kernel.BLOCK_ORDER`` (the products and tile loads of one block of 32 k's, checked without AMX): the six
    bf16x6 piece products (x hi with w hi, mid and lo; x mid with w hi and mid; x lo with w hi), each into all four
    accumulators once, every load but the block's last ones (the next block's) followed by a product that reads it,
    and the last ones leaving the tiles as the block's start expects (x hi, w lo)."""
    from pipejax.runner.cpu import amx_kernel

    held = {"x": {0: 0, 1: 0}, "w": {0: 2, 1: 2}}  # what block 0's loads before the loop put in the tiles
    products, unread, after = [], set(), {"x": {}, "w": {}}
    for op in amx_kernel.BLOCK_ORDER:
        if op[0] == "p":
            _, r, h = op
            products.append((held["x"][r], held["w"][h], r, h))
            unread -= {("x", r), ("w", h)}
        elif op[3]:  # the next block's
            after[op[0]][op[1]] = op[2]
        else:
            assert (op[0], op[1]) not in unread, f"{op} overwrites a tile no product read"
            held[op[0]][op[1]] = op[2]
            unread.add((op[0], op[1]))
    assert not unread
    assert sorted(products) == sorted((qx, qw, r, h) for qx, qw in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0))
                                      for r in range(2) for h in range(2))
    assert after == {"x": {0: 0, 1: 0}, "w": {0: 2, 1: 2}}


@pytest.mark.parametrize("rows", [1, 13, 420])
def test_q_and_k_heads_rotated_after_the_product(rows):
    """``rotary``: a layer's qkv [T, K, G + 2, D] with its query and key heads rotated by the kernel once the product
    is done (420 rows x 2 groups of 5 heads x 64 past ``NORM_PARALLEL_FLOATS``: over numba's threads where the handler
    is parallel), and by XLA after the dot where the kernel is not built, match ``rope.apply_rope`` of numpy's
    product; the value heads are left as they were."""
    from pipejax.runner.cpu import dense_kernel
    from pipejax.runner.rope import apply_rope, rope_tables

    K, G, D, E = 2, 3, 64, 96
    assert (rows * K * (G + 2) * D >= dense_kernel.NORM_PARALLEL_FLOATS) == (rows == 420)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, E), np.float32)
    w = rng.standard_normal((E, K, G + 2, D), np.float32)
    tables = rope_tables(jax.numpy.asarray(rng.integers(0, 4000, rows)), 1.0 / 10000 ** (np.arange(0, D, 2) / D),
                         jax.numpy.float32)
    y = np.tensordot(x.astype(np.float64), w.astype(np.float64), 1)  # [T, K, G + 2, D]
    turned = np.asarray(apply_rope(jax.numpy.asarray(y[:, :, :G + 1].reshape(rows, -1, D), np.float32), tables))
    want = y.copy()
    want[:, :, :G + 1] = turned.reshape(rows, K, G + 1, D)
    panels = Panels(jax.numpy.asarray(_in_panels(w, 1)))
    for matmul in (cpu_dense.matmul, functools.partial(cpu_dense.matmul, xla_rows=1)):
        step = jax.jit(lambda x, t, matmul=matmul: dense(x, panels, 1, matmul, rotary=(t, G + 2, G + 1)))
        np.testing.assert_allclose(np.asarray(step(x, tables)), want, rtol=1e-4, atol=1e-3, err_msg=f"{matmul}")
    with pytest.raises(ValueError, match="neither gated nor added"):
        cpu_dense.matmul(x, panels.data[None], 0, True, rotary=(tables, G + 2, G + 1))
