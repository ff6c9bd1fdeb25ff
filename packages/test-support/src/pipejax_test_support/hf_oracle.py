"""The oracle: checkpoints built and saved by transformers, and what transformers computes on them."""

from __future__ import annotations

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# architecture -> (config class, model class, what its tiny config adds)
ARCHS = {
    "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "MistralForCausalLM": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),
}


def make_hf_checkpoint(
    path, arch: str, seed: int = 0, dtype=torch.float32, max_shard_size: str | None = "200KB", **overrides
) -> transformers.PreTrainedModel:
    """A randomly initialised ``arch`` (``TINY`` updated with ``overrides``) saved by transformers in
    safetensors format (sharded at ``max_shard_size``; None: one file). Biases and norms are made
    non-trivial so their loading is really checked. The model comes back set never to stop early."""
    if arch not in ARCHS:
        raise ValueError(f"no tiny {arch!r} here; choose one of {sorted(ARCHS)}")
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **shards)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def fake_quantize_(model, quantization: str) -> transformers.PreTrainedModel:
    """``model`` with every linear weight and the embedding quantized and dequantized in place, as ``quantization``
    defines them: "int8" one symmetric scale per output row (its largest magnitude maps to 127); "int4" llama.cpp's
    Q4_0 in blocks of 32 along a row (the gguf package's own quantizer), and for the embedding and the LM head
    Q8_0. The weights a quantized pipejax stage computes with; transformers then runs them in float32. (A tied
    embedding and head share one weight: it is quantized once.)"""
    import gguf

    def fake(w: np.ndarray, vocabulary: bool) -> np.ndarray:
        if quantization == "int4":
            kind = gguf.GGMLQuantizationType.Q8_0 if vocabulary else gguf.GGMLQuantizationType.Q4_0
            return gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(w.shape)
        scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
        inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
        return np.clip(np.rint(w * inverse), -127, 127) * scale

    vocabulary = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    done = set()
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and id(weight) not in done:
                weight.copy_(torch.from_numpy(fake(weight.float().numpy(), id(weight) in vocabulary)))
                done.add(id(weight))
    return model


def hf_logits(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """Last-position logits of each prompt, one forward each."""
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1].float().numpy() for p in prompts]


def hf_prompt_logprobs(model, prompts: list[list[int]], top: int) -> list[list[tuple[float, int, list[int]]]]:
    """Per prompt, per prompt token after the first: (its logprob given the tokens before it, its rank in the
    vocabulary, the ids of the ``top`` most likely tokens there), from transformers' log-softmax."""
    out = []
    with torch.no_grad():
        for p in prompts:
            logprobs = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
            chosen = logprobs.gather(1, torch.tensor(p[1:])[:, None])[:, 0]
            ranks = 1 + (logprobs > chosen[:, None]).sum(dim=1)
            tops = logprobs.topk(top, dim=1).indices
            out.append([(float(c), int(r), t.tolist()) for c, r, t in zip(chosen, ranks, tops, strict=True)])
    return out


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate``, one prompt at a time, never stopping early."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
