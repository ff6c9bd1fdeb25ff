import hashlib
import json
import math
import pathlib

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from pipejax.runner.builtin_model import (
    BUILTIN_MODELS,
    EOS_TOKEN_ID,
    EOT_TOKEN_ID,
    cache_dir_from_env,
    default_cache_dir,
    ensure_builtin_model,
    full_hf_config,
    hf_tensor_shapes,
    write_checkpoint,
)

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
ARCH_CONFIGS = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"head_dim": 32},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 32},  # differs from hidden_size // heads on purpose
}


def file_hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def load_tensors(folder):
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def load_hf(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    problems = {key: value for key, value in info.items() if value and key != "error_msgs"}
    assert not problems, problems
    assert not info.get("error_msgs")
    return model.eval()


def test_same_arguments_give_identical_bytes_and_seed_changes_weights(tmp_path):
    config = {"architectures": ["Qwen2ForCausalLM"], **TINY}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        write_checkpoint(tmp_path / name, config, seed=seed, dtype="bfloat16", shards=2)
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")
    a, c = load_tensors(tmp_path / "a"), load_tensors(tmp_path / "c")
    assert a.keys() == c.keys()
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_transformers_loads_every_tensor_and_runs(tmp_path, arch):
    config = {"architectures": [arch], **TINY, **ARCH_CONFIGS[arch]}
    written = write_checkpoint(tmp_path, config, seed=1)
    model = load_hf(tmp_path)
    assert type(model).__name__ == arch
    ours = load_tensors(tmp_path)
    assert ours.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(param.detach().numpy(), ours[name], err_msg=name)
    assert model.config.head_dim == written["head_dim"]
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    with torch.no_grad():
        logits = model(torch.tensor([[256, 1, 2, 3, 200]])).logits
    assert logits.shape == (1, 5, TINY["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_arch_specific_tensors():
    def names(arch, **extra):
        return set(hf_tensor_shapes(full_hf_config({"architectures": [arch], **TINY, **extra})))

    layer = "model.layers.1.self_attn"
    qwen2, qwen3, llama = names("Qwen2ForCausalLM"), names("Qwen3ForCausalLM"), names("LlamaForCausalLM")
    assert {f"{layer}.{p}_proj.bias" for p in "qkv"} <= qwen2
    assert f"{layer}.o_proj.bias" not in qwen2
    assert {f"{layer}.q_norm.weight", f"{layer}.k_norm.weight"} <= qwen3
    assert not any(n.endswith(".bias") for n in qwen3 | llama)
    assert not any("_norm.weight" in n and "self_attn" in n for n in llama)
    assert "lm_head.weight" not in names("LlamaForCausalLM", tie_word_embeddings=True)


def test_sharded_checkpoint_has_same_weights_and_loads(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **TINY, "tie_word_embeddings": True}
    write_checkpoint(tmp_path / "one", config, seed=3)
    write_checkpoint(tmp_path / "three", config, seed=3, shards=3)
    files = sorted(p.name for p in (tmp_path / "three").glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((tmp_path / "three" / "model.safetensors.index.json").read_text())
    one, three = load_tensors(tmp_path / "one"), load_tensors(tmp_path / "three")
    assert set(index["weight_map"]) == one.keys() == three.keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in one.values())
    for name in one:
        np.testing.assert_array_equal(one[name], three[name])
    model = load_hf(tmp_path / "three")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bfloat16_checkpoint_holds_rounded_float32_weights(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **TINY}
    write_checkpoint(tmp_path / "f32", config, seed=5)
    write_checkpoint(tmp_path / "bf16", config, seed=5, dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    f32, bf16 = load_tensors(tmp_path / "f32"), load_tensors(tmp_path / "bf16")
    name = "model.layers.0.mlp.down_proj.weight"
    assert str(bf16[name].dtype) == "bfloat16"
    np.testing.assert_array_equal(f32[name].astype(bf16[name].dtype), bf16[name])
    model = load_hf(tmp_path / "bf16")
    np.testing.assert_array_equal(
        model.model.layers[0].mlp.down_proj.weight.detach().numpy(), bf16[name].astype(np.float32)
    )


def test_norm_weights_are_nontrivial_and_projections_small(tmp_path):
    write_checkpoint(tmp_path, {"architectures": ["LlamaForCausalLM"], **TINY}, seed=0)
    tensors = load_tensors(tmp_path)
    norm = tensors["model.norm.weight"]
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.05
    assert 0.015 < tensors["model.embed_tokens.weight"].std() < 0.025


def test_bad_configs_are_rejected_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        write_checkpoint(tmp_path, {"architectures": ["GPT2LMHeadModel"], **TINY}, seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        write_checkpoint(tmp_path, {"vocab_size": 320}, seed=0)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        full_hf_config({"architectures": ["Qwen2ForCausalLM"], **TINY, "head_dim": 32})
    with pytest.raises(ValueError, match="unknown built-in model"):
        ensure_builtin_model("huge", cache_dir=tmp_path)


def test_bench_preset_is_about_124m_parameters():
    shapes = hf_tensor_shapes(full_hf_config(BUILTIN_MODELS["bench"]))
    assert 120e6 < sum(math.prod(s) for s in shapes.values()) < 130e6


def test_cache_folder_from_the_callers_environment(monkeypatch):
    """The runner reads no environment: an edge passes its own to ``cache_dir_from_env``."""
    default = pathlib.Path.home() / ".cache" / "pipejax"
    assert default_cache_dir() == default and cache_dir_from_env({}) == default
    assert cache_dir_from_env({"PIPEJAX_CACHE_DIR": "/x/y"}) == pathlib.Path("/x/y")
    monkeypatch.setenv("PIPEJAX_CACHE_DIR", "/elsewhere")
    assert default_cache_dir() == default


def test_ensure_builtin_model_generates_once_into_the_cache(tmp_path):
    path = ensure_builtin_model(cache_dir=cache_dir_from_env({"PIPEJAX_CACHE_DIR": str(tmp_path)}))
    assert path == tmp_path / "builtin-default-v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builtin-default-v1"]  # no leftovers
    hashes = file_hashes(path)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(hashes)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model("default", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS_TOKEN_ID, EOT_TOKEN_ID]

    model = load_hf(path)
    assert model.config.num_key_value_heads == 4
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[256, 72, 105]])).logits).all()


def test_concurrent_winner_is_kept(tmp_path, monkeypatch):
    # Another process renames its finished folder into place while we generate.
    import pipejax.runner.builtin_model as builtin_model

    real_write = builtin_model.write_byte_tokenizer

    def write_then_lose_race(path, vocab_size):
        real_write(path, vocab_size)
        winner = tmp_path / "builtin-default-v1"
        winner.mkdir()
        (winner / "marker").write_text("winner")

    monkeypatch.setattr(builtin_model, "write_byte_tokenizer", write_then_lose_race)
    path = ensure_builtin_model("default", cache_dir=tmp_path)
    assert (path / "marker").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builtin-default-v1"]
