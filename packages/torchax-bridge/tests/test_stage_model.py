"""Stage-only modules: each stage builds and reads only its own layers, holds no torch weights,
and its JAX weights are sharded on the stage mesh by the runner's rules."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
from bridge_helpers import PROMPTS, make_hf_checkpoint, prefill_batch
from jax.sharding import PartitionSpec
from transformers import AutoConfig

from pipejax.pp_utils import stage_meshes
from pipejax.runner.checkpoint import SafetensorsIndex
from pipejax.runner.config import CacheConfig, ModelConfig, StageConfig
from pipejax.runner.inputs import build_step_inputs
from pipejax.runner.runner import StageRunner
from pipejax.runner.step_inputs import StepInputs
from pipejax.torchax_bridge import TorchStageParams, build_stage_module, load_stage_params, stage_hf_config


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_hf_checkpoint(path, "LlamaForCausalLM")
    return path, model, ModelConfig.from_pretrained(path)


def test_stages_hold_only_their_layers(llama, monkeypatch):
    path, model, cfg = llama
    read: list[str] = []
    original = SafetensorsIndex.read

    def recording_read(self, name, shape):
        read.append(name)
        return original(self, name, shape)

    monkeypatch.setattr(SafetensorsIndex, "read", recording_read)
    mesh = stage_meshes(jax.devices(), 1, 1)[0]

    first = load_stage_params(path, cfg, StageConfig(0, 2), mesh)
    assert isinstance(first, TorchStageParams)
    assert first.module.embed_tokens is not None and len(first.module.layers) == 2
    assert isinstance(first.module.norm, torch.nn.Identity) and not hasattr(first.module, "lm_head")
    assert all(p.device.type == "meta" for p in first.module.parameters())  # weights live in JAX only
    assert [m.self_attn.layer_idx for m in first.module.layers] == [0, 1]
    assert sorted({n.split(".")[2] for n in read if ".layers." in n}) == ["0", "1"]
    assert "model.norm.weight" not in read and "lm_head.weight" not in read

    read.clear()
    last = load_stage_params(path, cfg, StageConfig(1, 2), mesh)
    assert last.module.model.embed_tokens is None and len(last.module.model.layers) == 2
    assert [m.self_attn.layer_idx for m in last.module.model.layers] == [0, 1]  # indices into the stage's cache
    assert sorted({n.split(".")[2] for n in read if ".layers." in n}) == ["2", "3"]
    assert "model.embed_tokens.weight" not in read
    expected = model.state_dict()["model.layers.2.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(last.weights["model.layers.0.self_attn.q_proj.weight"]), expected)
    # The rotary buffers are computed, not loaded: they must equal transformers' own.
    np.testing.assert_array_equal(
        np.asarray(last.weights["model.rotary_emb.inv_freq"]), model.model.rotary_emb.inv_freq.numpy()
    )


@pytest.mark.parametrize("tp,kv_spec", [(2, PartitionSpec("tp", None)), (4, PartitionSpec(None, None))])
def test_weights_sharded_on_stage_mesh(llama, tp, kv_spec):
    path, _, cfg = llama
    params = load_stage_params(path, cfg, StageConfig(0, 1), stage_meshes(jax.devices(), 1, tp)[0])
    specs = {name: w.sharding.spec for name, w in params.weights.items()}
    layer = "model.layers.1."
    assert specs[layer + "self_attn.q_proj.weight"] == PartitionSpec("tp", None)  # column-parallel
    assert specs[layer + "self_attn.o_proj.weight"] == PartitionSpec(None, "tp")  # row-parallel
    assert specs[layer + "mlp.up_proj.weight"] == PartitionSpec("tp", None)
    assert specs[layer + "mlp.down_proj.weight"] == PartitionSpec(None, "tp")
    assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == PartitionSpec("tp", None)
    assert specs[layer + "input_layernorm.weight"] == PartitionSpec(None)
    assert specs[layer + "self_attn.k_proj.weight"] == kv_spec  # 2 KV heads: replicated when tp=4
    assert {d for w in params.weights.values() for d in w.devices()} == set(jax.devices()[:tp])


def test_tp_step_communicates_like_megatron(llama):
    """tp=2: the compiled step all-reduces twice per layer (after o_proj and down_proj) plus once
    for the vocab-parallel embedding, and all-gathers only the logits: weights are never gathered."""
    path, _, cfg = llama
    mesh = stage_meshes(jax.devices(), 1, 2)[0]
    runner = StageRunner(path, mesh, StageConfig(), CacheConfig(block_size=8, num_blocks=32), model_impl="torchax")
    batch = prefill_batch(PROMPTS)
    shape = runner.step_shape(batch)
    inputs = StepInputs(*(jax.device_put(a, runner._replicated) for a in build_step_inputs(batch, shape, 8)))
    lowered = runner._step.lower(runner.params, runner.kv_cache, inputs, None, shape=shape)
    hlo = lowered.compile().as_text()
    collectives = re.findall(r"= \S+?\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all)\(", hlo)
    assert sum(kind == "all-reduce" for _, kind in collectives) == 2 * cfg.num_layers + 1
    gathered = [dims for dims, kind in collectives if kind == "all-gather"]
    assert gathered and all(dims.split(",")[-1] == str(cfg.vocab_size) for dims in gathered), collectives
    assert not [kind for _, kind in collectives if kind not in ("all-reduce", "all-gather")]


def test_unsupported_architecture_is_refused(llama):
    path, _, cfg = llama
    hf = AutoConfig.from_pretrained(path)
    hf.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="model_impl='jax'"):
        stage_hf_config(hf, cfg, StageConfig())


def test_stage_config_slices_layer_types(tmp_path):
    make_hf_checkpoint(tmp_path, "Qwen2ForCausalLM")
    cfg = ModelConfig.from_pretrained(tmp_path)
    config = stage_hf_config(AutoConfig.from_pretrained(tmp_path), cfg, StageConfig(1, 2, (1, 3)))
    assert config.num_hidden_layers == 3 and len(config.layer_types) == 3
    assert not config.tie_word_embeddings
    module = build_stage_module(config, cfg, StageConfig(1, 2, (1, 3)))
    assert len(module.model.layers) == 3
