"""Checkpoints written by pipejax's generator, read back by transformers as the oracle."""

from __future__ import annotations

import random

import numpy as np
import torch
import transformers
from pipejax_test_support import hf_greedy

from pipejax.runner.builtin_model import write_checkpoint

__all__ = ["choice_mask", "hf_greedy", "hf_greedy_with", "make_checkpoint", "mixed_prompts", "only", "vllm_penalties",
           "write_byte_tokenizer"]

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


def hf_greedy_with(model, prompt: list[int], new: int, adjust=None, stop: int | None = None, **processors) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``new`` tokens): through ``generate`` with its logits
    ``processors`` (e.g. ``repetition_penalty``), or step by step with ``adjust(logits, prompt, outputs)`` (numpy)
    applied to its logits; ``stop``: its eos token."""
    with torch.no_grad():
        if adjust is None:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=stop,
                                 **processors)
            return out[0, len(prompt):].tolist()
        outputs: list[int] = []
        for _ in range(new):
            logits = model(torch.tensor([prompt + outputs])).logits[0, -1].numpy().astype(np.float64)
            outputs.append(int(np.argmax(adjust(logits, prompt, outputs))))
        return outputs


def vllm_penalties(presence: float, frequency: float):
    """vLLM's presence and frequency penalties: over the output's token counts."""
    def adjust(logits, prompt, outputs):
        counts = np.bincount(outputs, minlength=logits.size).astype(np.float64)
        return logits - frequency * counts - presence * (counts > 0)
    return adjust


def only(allowed: list[int]):
    def adjust(logits, prompt, outputs):
        masked = np.full_like(logits, -np.inf)
        masked[allowed] = logits[allowed]
        return masked
    return adjust


def write_byte_tokenizer(path, vocab: int = TINY["vocab_size"]) -> list[str]:
    """A tokenizer.json for the tiny checkpoints: ids 0-2 the special tokens, then one token per byte (GPT-2's
    byte-level alphabet: printable ASCII first, space and newline among them), no merges. Returns each id's text."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_char = {b: c for b, c in enumerate(_bytes_to_unicode())}
    order = [*range(33, 127), 32, 10, *[b for b in range(256) if b not in range(32, 127) and b != 10]]
    pieces = ["<unk>", "<s>", "</s>"] + [to_char[b] for b in order][: vocab - 3]
    assert set(pieces[3:]) <= set(alphabet)
    tok = tokenizers.Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    return [p if i < 3 else bytes([order[i - 3]]).decode("latin-1") for i, p in enumerate(pieces)]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def choice_mask(choices: list[str], texts: list[str]):
    """Greedy under a choice grammar, computed without a grammar engine: a token is allowed where the output's
    text followed by it is still the start of one of ``choices`` (``texts``: each token id's text)."""
    def adjust(logits, prompt, outputs):
        done = "".join(texts[t] for t in outputs)
        masked = np.full_like(logits, -np.inf)
        ok = [t for t in range(3, len(texts)) if any(c.startswith(done + texts[t]) for c in choices)]
        masked[ok] = logits[ok]
        return masked
    return adjust
