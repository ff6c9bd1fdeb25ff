"""Stage loading: chunked reads give the same sharded parameters, and a stage's load holds no tensor twice."""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_oracle import make_hf_checkpoint

from pipejax.pp_utils import logical_sharding, stage_mesh
from pipejax.runner import checkpoint
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.model import RULES, panel_spec, param_specs
from pipejax.runner.panels import DENSE_WEIGHTS, Panels


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):  # q/k/v biases, 2 KV heads (repeated for tp=4), untied LM head
    path = tmp_path_factory.mktemp("qwen2")
    make_hf_checkpoint(path, "Qwen2ForCausalLM")
    return path


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory):  # q/k norms, bf16 weights
    path = tmp_path_factory.mktemp("qwen3")
    make_hf_checkpoint(path, "Qwen3ForCausalLM", dtype=torch.bfloat16)
    return path


def _load(path, pp_rank, pp_size, tp, panels=False):
    cfg = ModelConfig.from_pretrained(path)
    stage = StageConfig(pp_rank, pp_size)
    mesh = stage_mesh(jax.devices()[:tp])
    return cfg, stage, mesh, checkpoint.load_stage_params(path, cfg, stage, mesh, panels=panels)


@pytest.mark.parametrize("fixture", ["qwen2", "qwen3_bf16"])
@pytest.mark.parametrize("pp_rank,pp_size,tp", [(0, 1, 1), (0, 2, 4), (1, 2, 2), (1, 2, 4)])
def test_chunked_load_matches_whole_tensor_load(request, monkeypatch, fixture, pp_rank, pp_size, tp):
    """Chunks that split tensors mid-shard (3 rows, or one head, at a time) assemble the same arrays
    with the same shardings as reading every tensor whole."""
    path = request.getfixturevalue(fixture)
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 1 << 40)
    _, _, _, whole = _load(path, pp_rank, pp_size, tp)
    cfg = ModelConfig.from_pretrained(path)
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 3 * cfg.hidden_size * np.dtype(cfg.dtype).itemsize)
    cfg, stage, mesh, chunked = _load(path, pp_rank, pp_size, tp)
    specs = param_specs(cfg, stage, tp)
    assert sorted(chunked) == sorted(whole) == sorted(specs)
    want_dtype = ml_dtypes.bfloat16 if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    for name, array in chunked.items():
        assert array.shape == specs[name].shape and array.dtype == want_dtype, name
        want = logical_sharding(mesh, specs[name].logical_axes, RULES)
        assert array.sharding.is_equivalent_to(want, array.ndim), name
        np.testing.assert_array_equal(np.asarray(array), np.asarray(whole[name]), err_msg=name)


def _unpanel(w: Panels, lead: int, contracted: int) -> np.ndarray:
    """A weight in panels back in its own layout [*lead, *in, *out] (through the loader's own view)."""
    view = checkpoint._logical_view(np.asarray(w.data), lead, contracted)
    return view.reshape(*view.shape[:-2], -1)


@pytest.fixture(scope="module")
def llama_panels(tmp_path_factory):  # all dense weights whole panels: head_dim 32, F 128, V 256 (64 a shard at tp 4)
    path = tmp_path_factory.mktemp("llama_panels")
    make_hf_checkpoint(path, "LlamaForCausalLM", tie_word_embeddings=False, hidden_size=128, num_attention_heads=4,
                       intermediate_size=128, vocab_size=256)
    return path


@pytest.mark.parametrize("fixture", ["qwen2", "llama_panels"])
@pytest.mark.parametrize("pp_rank,pp_size,tp", [(0, 1, 1), (1, 2, 2), (1, 2, 4)])
def test_dense_weights_in_panels_hold_the_same_values(request, monkeypatch, fixture, pp_rank, pp_size, tp):
    """Loaded in panels (in chunks that split tensors), each dense weight whose shards are whole panels holds
    exactly the values of the plain load, sharded as the panel layout's logical axes say; the rest is unchanged."""
    path = request.getfixturevalue(fixture)
    _, _, _, plain = _load(path, pp_rank, pp_size, tp)
    cfg = ModelConfig.from_pretrained(path)
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 3 * cfg.hidden_size * np.dtype(cfg.dtype).itemsize)
    cfg, stage, mesh, packed = _load(path, pp_rank, pp_size, tp, panels=True)
    specs = param_specs(cfg, stage, tp)
    in_panels = {name for name, w in packed.items() if isinstance(w, Panels)}
    if fixture == "llama_panels":  # all of them: nothing here keeps a dense weight out
        assert in_panels == set(DENSE_WEIGHTS) & set(specs), in_panels
    else:  # head_dim 16 and F 112 are no whole panels; o and down (E = 64) are
        assert {"layers.o", "layers.down"} <= in_panels and not in_panels & {"layers.qkv", "layers.gate_up"}
    for name, w in packed.items():
        if name not in in_panels:
            np.testing.assert_array_equal(np.asarray(w), np.asarray(plain[name]), err_msg=name)
            continue
        lead = 1 if name.startswith("layers.") else 0
        spec = panel_spec(specs[name], lead, DENSE_WEIGHTS[name])
        assert w.data.shape == spec.shape, name
        want = logical_sharding(mesh, spec.logical_axes, RULES)
        assert w.data.sharding.is_equivalent_to(want, w.data.ndim), name
        np.testing.assert_array_equal(_unpanel(w, lead, DENSE_WEIGHTS[name]), np.asarray(plain[name]), err_msg=name)


def test_embedding_rows_and_lm_head_columns_in_order(qwen2):
    """The vocab-chunked tensors land at the right rows (embedding) and columns (LM head)."""
    from safetensors.numpy import load_file

    tensors = {}
    for file in sorted(qwen2.glob("*.safetensors")):
        tensors.update(load_file(file))
    _, _, _, first = _load(qwen2, 0, 2, 4)
    _, _, _, last = _load(qwen2, 1, 2, 4)
    np.testing.assert_array_equal(np.asarray(first["embed"]), tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(last["lm_head"]), tensors["lm_head.weight"].T)


PROBE = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from pipejax.pp_utils import stage_mesh
from pipejax.runner import checkpoint
from pipejax.runner.config import ModelConfig, StageConfig

def hwm():  # this process's own peak (ru_maxrss would include the parent's peak from before exec)
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))

checkpoint.CHUNK_BYTES = 1 << 20
path = sys.argv[1]
cfg = ModelConfig.from_pretrained(path)
mesh = stage_mesh(jax.devices()[:1])
jax.device_put(jax.numpy.zeros(1)).block_until_ready()
base = hwm()
params = checkpoint.load_stage_params(path, cfg, StageConfig(1, 2), mesh)
jax.block_until_ready(params)
print(json.dumps({"growth": hwm() - base, "params": sum(p.nbytes for p in params.values()),
                  "largest": max(p.nbytes for p in params.values())}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_stage_load_holds_no_tensor_twice(tmp_path):
    """Peak RSS growth of loading a stage whose LM head is most of it (64 MiB) stays well under its
    parameters plus that tensor again (what copying a whole mapped tensor to the device costs)."""
    make_hf_checkpoint(
        tmp_path,
        "LlamaForCausalLM",
        vocab_size=131072,
        hidden_size=128,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["largest"] >= 0.9 * r["params"]
    extra = r["growth"] - r["params"]
    assert extra < 0.25 * r["largest"], f"load grew {r['growth'] / 2**20:.0f} MiB for {r['params'] / 2**20:.0f} MiB"
