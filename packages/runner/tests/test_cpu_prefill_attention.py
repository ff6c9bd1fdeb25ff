"""The CPU prefill-attention kernel (an XLA FFI custom call compiled by numba) against plain numpy attention,
and against the XLA formulation it replaces (``model.prefill_attention``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax.runner.cpu import prefill_attention as kernel
from pipejax.runner.model import prefill_attention

L, BLOCK, D = 2, 16, 64


def _reference(q, k, v, layer, tables, query_start, start_pos, Q, window, lens):
    """Each real query slot of each right-aligned row (its last ``lens[r]``) against the context it sees, one
    slot at a time (float64). Returns [R, Q, H, D] with the padding slots left at zero."""
    T, H, _ = q.shape
    K = k.shape[3]
    out = np.zeros((len(tables), Q, H, D))
    for r in range(len(tables)):
        for i in range(Q):
            t, pos = query_start[r] + i, start_pos[r] + i
            if i < Q - lens[r]:
                continue  # padding: its output is never read
            slots = [(tables[r, c // BLOCK], c % BLOCK) for c in range(pos + 1)]
            if window:
                slots = slots[max(0, pos + 1 - window):]
            for h in range(H):
                kh = h // (H // K)
                keys = np.stack([k[layer, b, o, kh] for b, o in slots]).astype(np.float64)
                values = np.stack([v[layer, b, o, kh] for b, o in slots]).astype(np.float64)
                scores = keys @ q[t, h] / np.sqrt(D)
                p = np.exp(scores - scores.max())
                out[r, i, h] = p @ values / p.sum()
    return out


def _real_slots(lens, Q):
    """[R, Q] mask of the slots that hold a token (a row is right-aligned: padding comes first)."""
    return np.arange(Q)[None, :] >= Q - np.asarray(lens)[:, None]


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, 0), (6, 2, 0), (6, 2, 21)])
def test_matches_numpy_attention(heads, kv_heads, window):
    """Full and short (left-padded) fresh prompts, a chunk after earlier context (start_pos > 0), a one-token row;
    block tables out of order; contexts that do not fill a 32-slot panel."""
    rng = np.random.default_rng(heads + window)
    Q, B = 40, 6
    lens = np.array([40, 7, 40, 1])  # tokens of this step per row
    before = np.array([0, 0, 50, 33])  # context cached by earlier steps
    N = 1 + len(lens) * B
    tables = (1 + rng.permutation(len(lens) * B)).reshape(len(lens), B).astype(np.int32)
    ends = np.cumsum(lens)
    query_start, start_pos = (ends - Q).astype(np.int32), (before + lens - Q).astype(np.int32)
    T = int(ends[-1]) + 3  # and 3 padding tokens
    q = rng.standard_normal((T, heads, D), np.float32)
    k = rng.standard_normal((L, N, BLOCK, kv_heads, D), np.float32)
    v = rng.standard_normal((L, N, BLOCK, kv_heads, D), np.float32)
    kernel_step = jax.jit(kernel.paged_prefill_attention, static_argnums=(7, 8))
    xla_step = jax.jit(prefill_attention, static_argnums=(6, 7))
    real = _real_slots(lens, Q)
    for layer in range(L):
        want = _reference(q, k, v, layer, tables, query_start, start_pos, Q, window, lens)
        got = np.asarray(kernel_step(q, k, v, jnp.int32(layer), query_start, start_pos, tables, Q, window))
        assert got.shape == want.shape and np.isfinite(got).all()
        np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5, err_msg=f"layer {layer}")
        xla = np.asarray(xla_step(q, k[layer], v[layer], query_start, start_pos, tables, Q, window or None))
        np.testing.assert_allclose(got[real], xla[real], rtol=1e-5, atol=1e-5, err_msg=f"layer {layer} vs XLA")


def test_kernel_is_built():
    """The kernel itself runs above, not XLA's fallback: numba builds the handler here."""
    assert kernel.prepare()


def test_each_device_runs_its_own_heads():
    """tp = 2: queries sharded over heads, the cache over KV heads, the kernel under shard_map on each device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipejax.pp_utils import TP_AXIS, stage_mesh

    mesh = stage_mesh(jax.devices()[:2])
    rng = np.random.default_rng(7)
    Q, H, K = 24, 4, 2
    tables = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    query_start, start_pos = np.array([0, 5], np.int32), np.array([0, -19], np.int32)  # a full row, a 5-token one
    q = rng.standard_normal((29, H, D), np.float32)
    k = rng.standard_normal((L, 7, BLOCK, K, D), np.float32)
    v = rng.standard_normal((L, 7, BLOCK, K, D), np.float32)
    q_sharded = jax.device_put(q, NamedSharding(mesh, P(None, TP_AXIS, None)))
    k_sharded, v_sharded = (jax.device_put(x, NamedSharding(mesh, P(None, None, None, TP_AXIS, None))) for x in (k, v))
    step = jax.jit(kernel.for_mesh(mesh), static_argnums=(7, 8))
    got = np.asarray(step(q_sharded, k_sharded, v_sharded, 1, query_start, start_pos, tables, Q, 0))
    real = _real_slots([24, 5], Q)
    want = _reference(q, k, v, 1, tables, query_start, start_pos, Q, 0, [24, 5])
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_the_runner_takes_the_kernel_on_cpu(tmp_path):
    """"auto": on CPU stages at tp = 1 and 2 where the head dim is whole panels (32), whichever of the kernel and
    XLA's formulation measured faster; XLA's below that (16), where asking for the kernel says why; "xla" and
    "cpu-kernel" force a choice; a choice that does not exist says what to use."""
    from hf_oracle import make_hf_checkpoint

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.config import CacheConfig
    from pipejax.runner.runner import StageRunner

    panels, small = tmp_path / "head32", tmp_path / "head16"
    make_hf_checkpoint(panels, "LlamaForCausalLM", max_position_embeddings=64, hidden_size=128)
    make_hf_checkpoint(small, "LlamaForCausalLM", max_position_embeddings=64)
    cache = CacheConfig(num_blocks=8)
    one = stage_mesh(jax.devices()[:1])
    for devices in (1, 2):
        runner = StageRunner(panels, stage_mesh(jax.devices()[:devices]), cache=cache)
        assert runner.cfg.head_dim == 32
        assert runner.prefill_attention == runner.selection.measured["prefill_attention"]["choice"]
    assert StageRunner(panels, one, cache=cache, prefill_attention="cpu-kernel").prefill_attention == "cpu-kernel"
    runner = StageRunner(small, one, cache=cache)
    assert runner.cfg.head_dim == 16 and runner.prefill_attention == "xla"
    assert "prefill_attention" not in runner.selection.measured  # nothing to measure where the kernel cannot run
    with pytest.raises(ValueError, match="prefill_attention='cpu-kernel' needs .* a head dim divisible by 32"):
        StageRunner(small, one, cache=cache, prefill_attention="cpu-kernel")
    assert StageRunner(panels, one, cache=cache, prefill_attention="xla").prefill_attention == "xla"
    with pytest.raises(ValueError, match="prefill_attention='flash'; use 'auto', 'xla' or 'cpu-kernel'"):
        StageRunner(panels, one, cache=cache, prefill_attention="flash")
