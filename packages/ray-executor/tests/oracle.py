"""Checkpoints written by pipejax's generator, read back by transformers as the oracle."""

from __future__ import annotations

import random

import torch
import transformers
from pipejax_test_support import hf_greedy

from pipejax.runner.builtin_model import write_checkpoint

__all__ = ["hf_greedy", "make_checkpoint", "mixed_prompts"]

TINY = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
EXTRA = {"Qwen3ForCausalLM": {"head_dim": 24}}


def make_checkpoint(path, arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    write_checkpoint(path, {**TINY, **EXTRA.get(arch, {}), "architectures": [arch], **overrides}, seed=seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def mixed_prompts(n: int, seed: int = 0, vocab: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
