"""One pipeline stage of a transformers PyTorch model, built on the meta device.

A stage's model is the Hugging Face class itself, configured with only the stage's decoder
layers (renumbered 0..L-1, which is also their index into the stage's KV cache). It holds no
weights: the meta-device skeleton is only the program; the weights live as sharded JAX arrays
(``stage_param_specs`` says where each comes from in the checkpoint and how it is sharded) and are
swapped in functionally at every call. What a stage does not own is a placeholder that holds no
weights: no embedding table off the first stage, an identity instead of the final norm and no
LM head off the last stage, so the stage's module is the base model (``model.model``) there.

The rotary embedding is rebuilt on the CPU: its ``inv_freq`` buffer is computed, not stored in
the checkpoint, and a meta (or ``to_empty``) copy of it is garbage. Tied embeddings become an
untied LM head that the last stage loads from the embedding weight.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.model import kv_heads_for_tp
from pipejax.torchax_bridge.attention import ATTENTION_NAME

# Architectures whose transformers classes share the layout this module relies on:
# model.embed_tokens, model.layers[i].self_attn.layer_idx, model.norm, model.rotary_emb, lm_head.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")

# Logical axes of the torch tensors (nn.Linear weights are [out, in]); the runner's RULES map them
# to the stage mesh: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding
# and LM head. Anything not listed (norms) is replicated.
TORCH_LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_tokens.weight": ("vocab", "embed"),
    "lm_head.weight": ("vocab", "embed"),
    "q_proj.weight": ("heads", "embed"),
    "q_proj.bias": ("heads",),
    "k_proj.weight": ("kv_heads", "embed"),
    "k_proj.bias": ("kv_heads",),
    "v_proj.weight": ("kv_heads", "embed"),
    "v_proj.bias": ("kv_heads",),
    "o_proj.weight": ("embed", "heads"),
    "o_proj.bias": ("embed",),
    "gate_proj.weight": ("mlp", "embed"),
    "gate_proj.bias": ("mlp",),
    "up_proj.weight": ("mlp", "embed"),
    "up_proj.bias": ("mlp",),
    "down_proj.weight": ("embed", "mlp"),
    "down_proj.bias": ("embed",),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class TorchParamSpec:
    """Where one parameter of the stage module comes from, its shape and its logical axes."""

    checkpoint_name: str
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def stage_hf_config(hf_config: PretrainedConfig, cfg: ModelConfig, stage: StageConfig) -> PretrainedConfig:
    """The Hugging Face config of the stage's model: its layers only, untied, paged attention."""
    arch = (hf_config.architectures or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} is not supported by the torchax bridge; it runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (or use model_impl='jax')"
        )
    layers = stage.layer_range(cfg)
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in layers]
    config.tie_word_embeddings = False
    config.use_cache = False
    return config


def build_stage_module(config: PretrainedConfig, cfg: ModelConfig, stage: StageConfig) -> torch.nn.Module:
    """The stage's module on the meta device (rotary buffers real, on the CPU).

    The last stage gets the ``*ForCausalLM`` model (its forward ends in the LM head); other stages
    get the base model (its forward returns the hidden states).
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(cfg), attn_implementation=ATTENTION_NAME)
    model.eval()
    base = model.model
    if not stage.is_first:
        base.embed_tokens = None  # the previous stage's hidden states come in as inputs_embeds
    if not stage.is_last:
        base.norm = torch.nn.Identity()
        model.lm_head = None
    base.rotary_emb = type(base.rotary_emb)(config=config)  # on the CPU: a real inv_freq
    return model if stage.is_last else base


def _checkpoint_name(local: str, layers: range, is_causal_lm: bool, tied: bool) -> str:
    name = local if is_causal_lm else f"model.{local}"
    if name == "lm_head.weight" and tied:
        return "model.embed_tokens.weight"
    match = _LAYER.match(name)
    if match:
        name = f"model.layers.{layers[int(match.group(1))]}." + name[match.end() :]
    return name


def stage_param_specs(
    module: torch.nn.Module, cfg: ModelConfig, stage: StageConfig, tp: int
) -> dict[str, TorchParamSpec]:
    """Parameter name in ``module`` -> checkpoint name, shape, logical axes (sharded over ``tp``)."""
    layers = stage.layer_range(cfg)
    # With tp > num_kv_heads the runner replicates KV heads in the cache; the small k/v projections
    # then stay whole on every device and attention repeats their heads.
    shard_kv = kv_heads_for_tp(cfg, tp) == cfg.num_kv_heads  # also: the native path's tp checks and errors
    specs = {}
    for local, param in module.named_parameters():
        suffix = ".".join(local.split(".")[-2:])
        axes = TORCH_LOGICAL_AXES.get(suffix, (None,) * param.dim())
        if not shard_kv:
            axes = tuple(None if a == "kv_heads" else a for a in axes)
        ckpt = _checkpoint_name(local, layers, stage.is_last, cfg.tie_word_embeddings)
        specs[local] = TorchParamSpec(ckpt, tuple(param.shape), axes)
    return specs
