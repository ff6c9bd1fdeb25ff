"""The Mixture-of-Experts benchmark's checkpoints: a Qwen3-MoE model with random weights made by transformers (fp32,
``save_pretrained``), and the dense Qwen3 model with the same active parameters (the same hidden size, layers and
heads; a dense FFN of top_k x the experts' width). ``moe_step.py`` here and ``benchmarks/moe_throughput.py`` (the
whole-system side) make them from the same sizes.

Default sizes: hidden 512, 8 layers, 8 query / 4 KV heads of 64, 8 experts of width 1024, top 2, vocabulary 32000
(embeddings tied): 123M parameters, 48M of them active per token (31M outside the embedding).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class MoeSizes:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 8
    top_k: int = 2
    expert_width: int = 1024  # moe_intermediate_size
    vocab: int = 32000

    @classmethod
    def tiny(cls) -> MoeSizes:
        """For smoke runs: seconds to build and compile."""
        return cls(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, expert_width=32, vocab=512)

    def hf_fields(self) -> dict[str, Any]:
        """The fields both checkpoints share."""
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab,
                "tie_word_embeddings": True, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": 0}

    def counts(self) -> dict[str, int]:
        """Parameters: total, active per token (top_k experts), and active outside the (tied) embedding."""
        E, L = self.hidden, self.layers
        attention = E * self.heads * self.head_dim * 2 + 2 * E * self.kv_heads * self.head_dim
        norms = 2 * E + 2 * self.head_dim  # input/post-attention norms, q/k norms
        expert = 3 * E * self.expert_width
        per_layer = attention + norms + E * self.experts  # + the router
        embedding = self.vocab * E
        total = L * (per_layer + self.experts * expert) + embedding + E
        active = L * (per_layer + self.top_k * expert) + embedding + E
        return {"total": total, "active": active, "active_without_embedding": active - embedding - E}


def make_checkpoint(path: str | Path, sizes: MoeSizes, dense: bool = False, seed: int = 0) -> str:
    """Save a random-weight Qwen3-MoE checkpoint of ``sizes`` (``dense``: the Qwen3 model of the same active
    parameters, FFN width top_k x expert_width) to ``path``, as transformers initialises and saves it (fp32)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if dense:
        config = transformers.Qwen3Config(**sizes.hf_fields(), intermediate_size=sizes.top_k * sizes.expert_width,
                                          architectures=["Qwen3ForCausalLM"])
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**sizes.hf_fields(), num_experts=sizes.experts,
                                             num_experts_per_tok=sizes.top_k, moe_intermediate_size=sizes.expert_width,
                                             norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
        model = transformers.Qwen3MoeForCausalLM(config)
    model = model.float().eval()
    model.generation_config.eos_token_id = None  # every run generates its full length
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return str(path)
