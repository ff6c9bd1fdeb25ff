"""The CPU decode-attention kernel (an XLA FFI custom call compiled by numba) against plain numpy attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax.runner.cpu import decode_attention as kernel

L, N, BLOCK, K, D = 3, 40, 16, 2, 32


def _reference(q, k, v, layer, tables, start_pos, window):
    """Softmax attention of each row's query heads over its visible context, one slot at a time."""
    R, H, _ = q.shape
    block, K = k.shape[2], k.shape[3]
    out = np.zeros_like(q)
    for r in range(R):
        slots = [(tables[r, c // block], c % block) for c in range(start_pos[r] + 1)]
        if window:
            slots = slots[max(0, start_pos[r] + 1 - window):]
        for h in range(H):
            kh = h // (H // K)
            keys = np.stack([k[layer, b, o, kh] for b, o in slots])
            values = np.stack([v[layer, b, o, kh] for b, o in slots])
            scores = keys @ q[r, h] / np.sqrt(q.shape[-1])
            p = np.exp(scores - scores.max())
            out[r, h] = p @ values / p.sum()
    return out


@pytest.mark.parametrize("heads,window", [(2, 0), (6, 0), (6, 20)])
def test_matches_numpy_attention(heads, window):
    rng = np.random.default_rng(heads + window)
    R, B = 5, 6
    k = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    v = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    q = rng.standard_normal((R, heads, D), np.float32)
    tables = rng.integers(0, N, (R, B)).astype(np.int32)
    start_pos = np.array([0, 1, 15, 16, B * BLOCK - 1], np.int32)  # first slot, block edges, a full table
    step = jax.jit(kernel.paged_decode_attention, static_argnums=(6,))
    for layer in (0, L - 1):
        got = step(q, k, v, jnp.int32(layer), tables, start_pos, window)
        np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, layer, tables, start_pos, window),
                                   rtol=1e-5, atol=1e-5, err_msg=f"layer {layer}")


@pytest.mark.parametrize("rows,kv_heads,B,spread", [(3, 4, 72, True), (9, 4, 8, True), (1, 1, 72, True),
                                                     (2, 4, 6, False), (100, 2, 4, True)])
def test_rows_and_kv_heads_split_between_tasks(rows, kv_heads, B, spread):
    """Few rows: each row's KV heads are split between tasks (3 rows x 4 KV heads: unevenly); many: one task
    per row, and past ``_MAX_WORKERS`` rows (100) some tasks take two rows in turn, on the same scratch; few rows of
    short context (2 x 96 slots): all on the calling thread."""
    from pipejax.runner.cpu import decode_kernel as cpu_decode_kernel

    assert (rows * B * BLOCK >= cpu_decode_kernel._MIN_PARALLEL_SLOTS) == spread  # the case tests what it says
    rng = np.random.default_rng(rows)
    H = 2 * kv_heads
    k = rng.standard_normal((L, N, BLOCK, kv_heads, D), np.float32)
    v = rng.standard_normal((L, N, BLOCK, kv_heads, D), np.float32)
    q = rng.standard_normal((rows, H, D), np.float32)
    tables = rng.integers(0, N, (rows, B)).astype(np.int32)
    start_pos = rng.integers(0, B * BLOCK, rows).astype(np.int32)
    got = jax.jit(kernel.paged_decode_attention, static_argnums=(6,))(q, k, v, jnp.int32(2), tables, start_pos, 0)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, 2, tables, start_pos, 0), rtol=1e-5, atol=1e-5)


def check_tiles():
    """numba's kernel itself (no fallback to XLA's formulation can hide a failure) against numpy, at block sizes
    and head dimensions that are and are not multiples of the scores tile (``attention_tiles.LANES`` slots, whole
    vectors of the head dimension): a block's last tile short, the head dimension's remainder in plain loops, a
    sliding window that starts inside a tile; on the calling thread and spread."""
    from pipejax.runner.cpu import decode_kernel

    rng = np.random.default_rng(7)
    for block, heads, kv_heads, dim, window in [(16, 6, 2, 64, 0), (12, 4, 1, 36, 0), (24, 3, 3, 8, 0),
                                                 (16, 8, 2, 128, 21), (4, 2, 2, 20, 0)]:
        blocks, rows = 30, 5
        per_row = -(-decode_kernel._MIN_PARALLEL_SLOTS // (rows * block))  # enough context to spread
        k = rng.standard_normal((2, blocks, block, kv_heads, dim), np.float32)
        v = rng.standard_normal((2, blocks, block, kv_heads, dim), np.float32)
        q = rng.standard_normal((rows, heads, dim), np.float32)
        tables = rng.integers(1, blocks, (rows, per_row)).astype(np.int32)
        start_pos = np.array([0, block - 1, block, 2 * block + 3, per_row * block - 1], np.int32)
        want = _reference(q, k, v, 1, tables, start_pos, window)
        for attend in (decode_kernel._attend, decode_kernel._attend_parallel):
            out = np.full_like(q, np.nan)
            attend(q, k.ravel(), v.ravel(), k.shape, 1, tables, start_pos, window, out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"block {block}, dim {dim}")


def test_the_tiles_take_any_block_size_and_head_dimension():
    check_tiles()


def test_the_avx2_tiles_where_this_host_has_wider_vectors(tmp_path):
    """Compiled for an AVX2 target (``NUMBA_CPU_NAME=haswell``: 8 lanes) on a host whose own target is wider, so
    that both tile widths are checked there; on an AVX2 host the test above has checked them."""
    import os
    import subprocess
    import sys

    from pipejax.runner.cpu import attention_tiles

    if attention_tiles.LANES == 8:
        pytest.skip("this host's own target has 8 lanes: test_the_tiles_take_any_block_size_and_head_dimension")
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CACHE_DIR": str(tmp_path)}
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
              "from pipejax.runner.cpu import attention_tiles\nassert attention_tiles.LANES == 8\n"
              "from test_cpu_decode_attention import check_tiles\ncheck_tiles()\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_used_inside_a_scan_that_updates_the_cache():
    """The runner's shape of use: the cache is written in place each layer, then read by the kernel."""
    rng = np.random.default_rng(1)
    R, B, H = 3, 4, 4
    tables = np.arange(1, 1 + R * B, dtype=np.int32).reshape(R, B)
    start_pos = np.array([5, 30, 63], np.int32)
    q = jnp.asarray(rng.standard_normal((L, R, H, D), np.float32))
    new_k = jnp.asarray(rng.standard_normal((L, R, K, D), np.float32))
    k0 = rng.standard_normal((L, N, BLOCK, K, D), np.float32)

    def run(use_kernel):
        def body(k_all, layer):
            block, offset = tables[np.arange(R), start_pos // BLOCK], start_pos % BLOCK
            k_all = k_all.at[layer, block, offset].set(new_k[layer])
            if use_kernel:
                out = kernel.paged_decode_attention(q[layer], k_all, k_all, layer, tables, start_pos, 0)
            else:
                out = jnp.asarray(0.0)
            return k_all, out

        return jax.jit(lambda k: jax.lax.scan(body, k, jnp.arange(L)))(jnp.asarray(k0))

    k_after, outs = run(True)
    k_ref, _ = run(False)
    np.testing.assert_array_equal(np.asarray(k_after), np.asarray(k_ref))
    for layer in range(L):
        want = _reference(np.asarray(q[layer]), np.asarray(k_ref), np.asarray(k_ref), layer, tables, start_pos, 0)
        np.testing.assert_allclose(np.asarray(outs[layer]), want, rtol=1e-5, atol=1e-5)


def test_tp2_runs_each_device_on_its_own_heads():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipejax.pp_utils import stage_mesh

    mesh = stage_mesh(jax.devices()[:2])
    rng = np.random.default_rng(2)
    R, B, H = 4, 5, 6
    k = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    v = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    q = rng.standard_normal((R, H, D), np.float32)
    tables = rng.integers(0, N, (R, B)).astype(np.int32)
    start_pos = np.array([3, 17, 40, 79], np.int32)
    on = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    cache = P(None, None, None, "tp", None)
    step = jax.jit(kernel.for_mesh(mesh), static_argnums=(6,))
    got = step(on(q, P(None, "tp", None)), on(k, cache), on(v, cache), jnp.int32(1), tables, start_pos, 0)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, 1, tables, start_pos, 0), rtol=1e-5, atol=1e-5)


def test_the_runner_says_which_attention_runs_and_refuses_what_cannot(tmp_path):
    from hf_oracle import make_hf_checkpoint

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.config import CacheConfig, ModelConfig
    from pipejax.runner.runner import StageRunner

    make_hf_checkpoint(tmp_path, "LlamaForCausalLM", max_position_embeddings=64)
    mesh, cache = stage_mesh(jax.devices()[:1]), CacheConfig(num_blocks=8)
    runner = StageRunner(tmp_path, mesh, cache=cache)
    assert runner.decode_attention == runner.selection.measured["decode_attention"]["choice"]  # measured here
    assert StageRunner(tmp_path, mesh, cache=cache, decode_attention="cpu-kernel").decode_attention == "cpu-kernel"
    assert StageRunner(tmp_path, mesh, cache=cache, decode_attention="xla").decode_attention == "xla"
    bf16 = ModelConfig.from_pretrained(tmp_path, dtype="bfloat16")
    assert StageRunner(tmp_path, mesh, cache=cache, model_config=bf16).decode_attention == "xla"
    with pytest.raises(ValueError, match="bfloat16"):
        StageRunner(tmp_path, mesh, cache=cache, model_config=bf16, decode_attention="cpu-kernel")
    with pytest.raises(ValueError, match="'flash'"):
        StageRunner(tmp_path, mesh, cache=cache, decode_attention="flash")


FALLBACK = """
import logging, sys
import jax, numpy as np
from pipejax.runner.cpu import decode_attention as cpu_decode_attention, decode_kernel as cpu_decode_kernel
build = cpu_decode_kernel.compile_handler
def broken(parallel=False):
    if parallel or sys.argv[2] == "no-llvm":
        raise RuntimeError("no LLVM here" if sys.argv[2] == "no-llvm" else "no TBB here")
    return build(parallel=False)
cpu_decode_kernel.compile_handler = broken
logging.basicConfig(level=logging.WARNING)
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 4, 16, 2, 32), np.float32)
q = rng.standard_normal((2, 4, 32), np.float32)
tables, pos = np.array([[1, 2], [3, 0]], np.int32), np.array([20, 9], np.int32)
out = jax.jit(cpu_decode_attention.paged_decode_attention, static_argnums=(6,))(q, k, k, 0, tables, pos, 0)
np.save(sys.argv[1], np.asarray(out))
"""


@pytest.mark.parametrize("missing,warning", [
    ("no-llvm", "could not be built (RuntimeError: no LLVM here); using XLA's formulation"),
    ("no-tbb", "runs on one thread: its parallel build failed (RuntimeError: no TBB here)"),
])
def test_a_kernel_that_cannot_be_built_falls_back_with_a_warning(tmp_path, missing, warning):
    """No numba build at all: XLA's formulation; no TBB: the kernel on the calling thread. Same results."""
    import subprocess
    import sys

    out = tmp_path / "out.npy"
    proc = subprocess.run([sys.executable, "-c", FALLBACK, str(out), missing], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert warning in proc.stderr
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 4, 16, 2, 32), np.float32)
    q = rng.standard_normal((2, 4, 32), np.float32)
    want = _reference(q, k, k, 0, np.array([[1, 2], [3, 0]]), np.array([20, 9]), 0)
    np.testing.assert_allclose(np.load(out), want, rtol=1e-5, atol=1e-5)


def test_concurrent_callers_each_get_their_own_rows():
    """In-process pipeline stages run the kernel from two threads at once (its parallel loop on TBB)."""
    import threading

    rng = np.random.default_rng(3)
    R, B, H = 8, 6, 4
    k = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    v = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    tables = rng.integers(0, N, (R, B)).astype(np.int32)
    start_pos = rng.integers(0, B * BLOCK, R).astype(np.int32)
    queries = [rng.standard_normal((R, H, D), np.float32) for _ in range(2)]
    want = [_reference(q, k, v, 1, tables, start_pos, 0) for q in queries]
    step = jax.jit(kernel.paged_decode_attention, static_argnums=(6,))
    step(queries[0], k, v, jnp.int32(1), tables, start_pos, 0).block_until_ready()  # compile once
    errors = []

    def caller(i):
        try:
            for _ in range(50):
                got = step(queries[i], k, v, jnp.int32(1), tables, start_pos, 0)
                np.testing.assert_allclose(np.asarray(got), want[i], rtol=1e-5, atol=1e-5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    import numba

    assert numba.threading_layer() == "tbb"  # the parallel build ran (tbb is a dependency)


@pytest.mark.parametrize("rows", [5, 40])
def test_reads_the_query_heads_out_of_a_layers_qkv(rows, monkeypatch):
    """``heads``: q_rows is a layer's qkv [R, K (G + 2), D] (per KV head its G query heads, its key, its value), as a
    decode-only step on one device hands it over; the kernel (40 rows: over numba's threads where the handler is
    parallel) and XLA's formulation where the kernel is not built match numpy's attention of the query heads
    alone."""
    G = 3
    rng = np.random.default_rng(rows)
    B = 6
    k = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    v = rng.standard_normal((L, N, BLOCK, K, D), np.float32)
    qkv = rng.standard_normal((rows, K, G + 2, D), np.float32)
    q = qkv[:, :, :G].reshape(rows, K * G, D)
    tables = rng.integers(0, N, (rows, B)).astype(np.int32)
    start_pos = rng.integers(0, B * BLOCK, rows).astype(np.int32)
    want = _reference(q, k, v, 1, tables, start_pos, 0)
    for built in (True, False):
        if not built:
            monkeypatch.setattr(kernel, "_handler", lambda: None)
        step = jax.jit(kernel.paged_decode_attention, static_argnums=(6, 7))
        got = step(qkv.reshape(rows, -1, D), k, v, jnp.int32(1), tables, start_pos, 0, K * G)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"kernel built: {built}")
