"""Per-layer views of stacked weights: the same memory, each layer sharded as the stacked weight past its first
axis, alive as long as the views are."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pipejax.pp_utils import stage_mesh
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.cpu import layer_views


def per_layer(params):
    """``layer_views.per_layer`` for a one-stage dense model of as many layers as the stacked weights have."""
    layers = next(w for n, w in params.items() if n.startswith("layers.")).shape[0]
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                               "intermediate_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
                               "num_key_value_heads": 1})
    return layer_views.per_layer(params, cfg, StageConfig())


def _stacked(mesh, shape, spec):
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return values, jax.device_put(values, NamedSharding(mesh, spec))


def test_each_layer_is_a_view_of_the_stacked_weight():
    mesh = stage_mesh(jax.devices()[:1])
    values, w = _stacked(mesh, (3, 16, 32), P(None, None, None))
    norm_values, norm = _stacked(mesh, (3, 16), P(None, None))
    params = per_layer({"layers.up": w, "layers.input_norm": norm, "final_norm": jax.numpy.ones(16)})
    assert sorted(params) == ["final_norm", "layers"]
    assert [sorted(p) for p in params["layers"]] == [["input_norm", "up"]] * 3
    base = w.addressable_shards[0].data.unsafe_buffer_pointer()
    for i, layer in enumerate(params["layers"]):
        assert layer["up"].unsafe_buffer_pointer() == base + i * 16 * 32 * 4  # no copy
        np.testing.assert_array_equal(np.asarray(layer["up"]), values[i])
        np.testing.assert_array_equal(np.asarray(layer["input_norm"]), norm_values[i])
    del w, norm
    gc.collect()
    np.testing.assert_array_equal(np.asarray(params["layers"][2]["up"]), values[2])  # the memory outlives `w`


def test_sharded_weights_keep_their_sharding_past_the_layer_axis():
    mesh = stage_mesh(jax.devices()[:2])
    values, w = _stacked(mesh, (2, 8, 4, 6), P(None, None, "tp", None))
    layers = per_layer({"layers.q": w})["layers"]
    for i, layer in enumerate(layers):
        assert layer["q"].sharding.spec == P(None, "tp", None)
        np.testing.assert_array_equal(np.asarray(layer["q"]), values[i])
        for shard, stacked_shard in zip(layer["q"].addressable_shards, w.addressable_shards, strict=True):
            assert shard.device == stacked_shard.device
            layer_bytes = stacked_shard.data.nbytes // 2
            assert shard.data.unsafe_buffer_pointer() == stacked_shard.data.unsafe_buffer_pointer() + i * layer_bytes


def test_small_unaligned_layers_are_copied_large_ones_refused():
    """A [L, 24] float32 norm's layers start 96 bytes apart, off the 64-byte alignment the CPU backend adopts:
    such small slices are copied; a large weight whose layers cannot be aliased is an error, not a copy."""
    mesh = stage_mesh(jax.devices()[:1])
    values, norm = _stacked(mesh, (3, 24), P(None, None))
    layers = per_layer({"layers.q_norm": norm})["layers"]
    for i, layer in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(layer["q_norm"]), values[i])
    _, big = _stacked(mesh, (2, 40961), P(None, None))  # 160 KiB + 4 bytes per layer: layer 1 is unaligned
    with pytest.raises(RuntimeError, match=r"layer 1 of a \(2, 40961\) weight \(163844 bytes\) was copied"):
        per_layer({"layers.up": big})


def test_the_runner_unrolls_cpu_decode_steps_and_falls_back_to_the_scan(tmp_path, monkeypatch, caplog):
    from hf_oracle import make_hf_checkpoint

    from pipejax.runner.config import CacheConfig
    from pipejax.runner.cpu import layer_views
    from pipejax.runner.runner import StageRunner

    make_hf_checkpoint(tmp_path, "LlamaForCausalLM", max_position_embeddings=64)
    mesh, cache = stage_mesh(jax.devices()[:1]), CacheConfig(num_blocks=8)
    assert StageRunner(tmp_path, mesh, cache=cache).decode_layers == "unrolled"
    assert StageRunner(tmp_path, mesh, cache=cache, decode_layers="scan").decode_layers == "scan"
    with pytest.raises(ValueError, match="decode_layers='loop'; use 'auto', 'scan' or 'unrolled'"):
        StageRunner(tmp_path, mesh, cache=cache, decode_layers="loop")

    def refuse(params, cfg, stage):
        raise RuntimeError("layer 1 of a (2, 3) weight was copied, not aliased")

    monkeypatch.setattr(layer_views, "per_layer", refuse)
    assert StageRunner(tmp_path, mesh, cache=cache).decode_layers == "scan"
    assert "decode steps run the layer scan: layer 1 of a (2, 3) weight was copied" in caplog.text
    with pytest.raises(RuntimeError, match="was copied"):
        StageRunner(tmp_path, mesh, cache=cache, decode_layers="unrolled")
