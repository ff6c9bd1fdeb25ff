"""The GGUF architectures pipejax loads, and llama.cpp's conventions for each: the Hugging Face config a file's
metadata describes (``hf_config``) and the GGUF tensor that holds each Hugging Face tensor (``Architecture.place``).

- ``llama``: LlamaForCausalLM. llama.cpp's converter reorders the rows of each Q and K head for its RoPE (the two
  rotated halves of a head interleaved); ``gguf_file.GGUFTensor`` puts them back.
- ``qwen3moe``: Qwen3MoeForCausalLM. Qwen3's attention (q/k RMS norms; NeoX RoPE, so Q and K keep Hugging Face's
  row order) and in every layer a Mixture of Experts: the router ``ffn_gate_inp`` [X, E] and the X experts stacked
  in 3-D tensors, ``ffn_gate_exps`` / ``ffn_up_exps`` [X, Fm, E] and ``ffn_down_exps`` [X, E, Fm] (in Hugging Face
  order, expert outermost: llama.cpp's converter stacks the per-expert weights on a new first axis), so expert e's
  weight is one contiguous block of rows. llama.cpp always renormalises qwen3moe's top-k routing weights.

Any other Mixture-of-Experts file (qwen2moe, deepseek2, llama.cpp's Mixtral: architecture 'llama' with
``llama.expert_count``, ...) and any other architecture is a ``GGUFError`` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipejax.runner.errors import GGUFError

# llama.cpp's Mixture-of-Experts architectures (general.architecture) that pipejax does not load from GGUF.
OTHER_MOE_ARCHITECTURES = ("qwen2moe", "mixtral", "deepseek", "deepseek2", "olmoe", "granitemoe", "dbrx", "arctic",
                           "phimoe", "glm4moe", "gpt-oss", "llama4", "bailingmoe", "ernie4_5-moe", "hunyuan-moe")
# transformers' MoE architectures the runner loads from their safetensors checkpoints (the way out of a refusal).
_SAFETENSORS_MOE = "Qwen3MoeForCausalLM, MixtralForCausalLM and Qwen2MoeForCausalLM"

# Hugging Face name -> GGUF name: the tensors outside the layers, then those of a layer (model.layers.{i}.<name>
# -> blk.{i}.<name>).
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_ATTENTION_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_QK_NORM_NAMES = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
_DENSE_MLP_NAMES = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_ROUTER_NAMES = {"mlp.gate.weight": "ffn_gate_inp.weight"}
# Expert e's projection (model.layers.{i}.mlp.experts.{e}.<proj>.weight) -> the 3-D tensor of all the layer's experts.
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                 "down_proj": "ffn_down_exps.weight"}


@dataclasses.dataclass(frozen=True)
class TensorPlace:
    """Where a Hugging Face tensor is in a GGUF file: a whole tensor, or one expert's slice of a 3-D one."""

    name: str  # the GGUF tensor
    expert: int | None = None  # the index on the experts tensor's first (outermost) axis; None: the whole tensor


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One GGUF architecture (``general.architecture``) as pipejax loads it."""

    gguf_name: str
    hf_architecture: str
    model_type: str
    layer_names: dict[str, str]  # a layer's Hugging Face tensor -> its GGUF tensor (names after the layer prefix)
    expert_names: dict[str, str]  # an expert's projection -> the layer's 3-D experts tensor ({}: no experts)
    rope_rows_interleaved: bool  # Q/K rows reordered by llama.cpp's converter for its (non-NeoX) RoPE

    def place(self, hf_name: str) -> TensorPlace:
        if hf_name in _GLOBAL_NAMES:
            return TensorPlace(_GLOBAL_NAMES[hf_name])
        _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.<rest>
        if rest in self.layer_names:
            return TensorPlace(f"blk.{layer}.{self.layer_names[rest]}")
        parts = rest.split(".")  # mlp.experts.{e}.<proj>.weight
        if len(parts) == 5 and parts[:2] == ["mlp", "experts"] and parts[3] in self.expert_names:
            return TensorPlace(f"blk.{layer}.{self.expert_names[parts[3]]}", int(parts[2]))
        raise KeyError(f"{hf_name!r} has no GGUF tensor in llama.cpp's {self.gguf_name!r} architecture")


ARCHITECTURES = {
    a.gguf_name: a
    for a in (
        Architecture("llama", "LlamaForCausalLM", "llama", {**_ATTENTION_NAMES, **_DENSE_MLP_NAMES}, {}, True),
        Architecture("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe",
                     {**_ATTENTION_NAMES, **_QK_NORM_NAMES, **_ROUTER_NAMES}, _EXPERT_NAMES, False),
    )
}
MOE_ARCHITECTURES = tuple(name for name, a in ARCHITECTURES.items() if a.expert_names)


def architecture(fields: dict[str, Any], path: object = "") -> Architecture:
    """The architecture of a file with metadata ``fields``, if pipejax loads it; else a ``GGUFError`` naming it."""
    arch = fields.get("general.architecture")
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    known = ARCHITECTURES.get(arch)
    if known is not None and (known.expert_names or not experts):
        return known
    if experts or arch in OTHER_MOE_ARCHITECTURES:
        count = f" ({experts} experts)" if experts else ""
        raise GGUFError(
            f"GGUF file {str(path)!r} holds a Mixture-of-Experts model of llama.cpp architecture {arch!r}{count}; "
            f"pipejax loads Mixture-of-Experts GGUF files of architecture {', '.join(map(repr, MOE_ARCHITECTURES))} "
            f"(Qwen3-MoE, experts in 3-D ffn_*_exps tensors) only. Give the model's Hugging Face checkpoint folder "
            f"instead: {_SAFETENSORS_MOE} load from safetensors"
        )
    raise GGUFError(
        f"GGUF file {str(path)!r} holds a {arch!r} model; pipejax loads GGUF architectures "
        f"{', '.join(map(repr, ARCHITECTURES))} (for others give the Hugging Face checkpoint folder)"
    )


def hf_config(reader, path: object = "") -> dict:
    """The model's hyper-parameters as a Hugging Face ``config.json`` dict, from the metadata of ``reader`` (a parsed
    GGUF header: ``.fields``, ``.tensors``)."""
    fields = reader.fields
    arch = architecture(fields, path)
    name = arch.gguf_name
    scaling = fields.get(f"{name}.rope.scaling.type", "none")
    tensor_names = set(reader.tensors)
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            f"GGUF file {str(path)!r} uses RoPE scaling ({scaling!r}, rope_freqs); pipejax's GGUF loader supports "
            f"plain RoPE only; give the Hugging Face checkpoint folder instead"
        )

    def meta(key, default=None):
        value = fields.get(f"{name}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF file {str(path)!r} lacks metadata {name}.{key}; is it a complete llama.cpp model?")
        return value

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = fields.get("tokenizer.ggml.tokens")
    theta = float(meta("rope.freq_base", 10000.0))
    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": int(meta("vocab_size", len(tokens) if tokens else None)),
        "hidden_size": hidden,
        # a MoE model's dense MLP width (none of qwen3moe's layers is dense)
        "intermediate_size": int(meta("feed_forward_length", 0 if arch.expert_names else None)),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "dtype": "float32",  # what the tensors are dequantized to unless the caller asks for bfloat16
    }
    if arch.expert_names:
        config |= {
            "num_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises (the file does not say)
            "decoder_sparse_step": 1,  # every layer's MLP is a MoE (llama.cpp's qwen3moe has no dense layers)
            "mlp_only_layers": [],
        }
    return config
