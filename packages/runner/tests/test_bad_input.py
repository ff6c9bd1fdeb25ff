"""Bad checkpoints and layouts fail with errors that name the value and the fix."""

import json

import jax
import pytest
from hf_oracle import ChainedStages, make_hf_checkpoint, prefill_batch
from safetensors.numpy import load_file, save_file

from pipejax.pp_utils import stage_mesh
from pipejax.runner.checkpoint import CheckpointError
from pipejax.runner.config import CacheConfig, ModelConfig, StageConfig
from pipejax.runner.runner import StageRunner


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint(path, "LlamaForCausalLM", max_position_embeddings=64)
    return path


def _single_file_copy(src, dst, edit):
    """Merge the sharded checkpoint into one file, applying ``edit`` to the tensor dict."""
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_config_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_tensor_is_named(llama, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _single_file_copy(llama, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name}.*expected shape \[112, 64\].*missing"):
        StageRunner(path, stage_mesh(jax.devices()[:1]), cache=CacheConfig(num_blocks=8))


def test_wrong_shape_is_named(llama, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _single_file_copy(llama, tmp_path / "m", lambda t: t.update({name: t[name][:16]}))
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \[16, 64\].*implies \[32, 64\]"):
        StageRunner(path, stage_mesh(jax.devices()[:1]), cache=CacheConfig(num_blocks=8))


def test_stage_reads_only_its_own_tensors(llama, tmp_path):
    """A stage loads even when the other stages' tensors are absent from the checkpoint."""

    def keep_stage1(t):
        for k in [k for k in t if k.startswith(("model.layers.0.", "model.layers.1.", "model.layers.2."))]:
            del t[k]
        del t["model.embed_tokens.weight"]

    path = _single_file_copy(llama, tmp_path / "m", keep_stage1)
    runner = StageRunner(path, stage_mesh(jax.devices()[:1]), StageConfig(1, 2), CacheConfig(num_blocks=8))
    assert sorted(runner.params) == sorted(
        ["final_norm", "lm_head"] + [f"layers.{n}" for n in "input_norm qkv o post_norm gate_up down".split()]
    )
    assert runner.params["layers.qkv"].shape[0] == 3


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_not_dividing_heads(llama, tp):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} does not divide num_attention_heads=4"):
        StageRunner(llama, stage_mesh(jax.devices()[:tp]), cache=CacheConfig(num_blocks=8))


def test_prompt_longer_than_max_model_len(llama):
    stages = ChainedStages(llama, 1, 1)
    with pytest.raises(ValueError, match="reaches position 70, beyond max_model_len=64"):
        stages.logits(prefill_batch([list(range(70))]))
    # the runner is still usable afterwards
    assert stages.logits(prefill_batch([[1, 2, 3]])).shape == (1, 160)
