"""Test helpers: a tiny Llama checkpoint made by transformers (the shared oracle, ``pipejax_test_support``),
and a minimal prefill-then-decode loop that drives stage workers through any ``execute``."""

from __future__ import annotations

from collections.abc import Callable

import transformers
from pipejax_test_support import hf_greedy, make_hf_checkpoint

from pipejax.runner.batch import ModelBatch, SamplerOutput, SamplingParams, ScheduledRequest
from pipejax.runner.config import CacheConfig, SchedulerConfig

__all__ = ["CACHE", "GREEDY", "MAX_NEW_TOKENS", "PROMPTS", "greedy_decode", "hf_greedy", "make_llama_checkpoint"]

# Mixed lengths; prompt + MAX_NEW_TOKENS stays within BLOCKS_PER_REQUEST blocks.
PROMPTS = [[1, 17, 42, 99, 7], [1, 5, 150, 23, 64, 88, 12, 3, 140, 77, 31, 9], [1, 120, 33], [1, 8, 8, 8, 60, 61, 62]]
MAX_NEW_TOKENS = 8
BLOCK_SIZE = 8
MAX_MODEL_LEN = 64
BLOCKS_PER_REQUEST = MAX_MODEL_LEN // BLOCK_SIZE
# Block 0 is the padding block; every prompt gets its own BLOCKS_PER_REQUEST blocks after it.
NUM_BLOCKS = 1 + len(PROMPTS) * BLOCKS_PER_REQUEST
CACHE = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
LIMITS = SchedulerConfig(max_num_seqs=len(PROMPTS), max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN)
GREEDY = SamplingParams(temperature=0.0)


def make_llama_checkpoint(path, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A randomly initialised 4-layer ``LlamaForCausalLM`` saved by transformers in one safetensors file."""
    return make_hf_checkpoint(path, "LlamaForCausalLM", seed, num_hidden_layers=4, max_shard_size=None)


def greedy_decode(
    execute: Callable[[ModelBatch], SamplerOutput], prompts: list[list[int]], max_new_tokens: int, first_step: int = 0
) -> list[list[int]]:
    """Prefill every prompt in one ragged step, then decode them together, one token per step.

    ``execute`` runs one ``ModelBatch`` through the whole pipeline and returns the last stage's
    ``SamplerOutput``.
    """
    tables = [tuple(range(1 + i * BLOCKS_PER_REQUEST, 1 + (i + 1) * BLOCKS_PER_REQUEST)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    positions = [0] * len(prompts)  # tokens already in the KV cache
    pending = [tuple(p) for p in prompts]  # tokens to compute in the next step
    step = first_step
    while any(len(o) < max_new_tokens for o in outputs):
        reqs = tuple(
            ScheduledRequest(f"r{i}", pending[i], positions[i], tables[i], GREEDY, output_index=len(outputs[i]))
            for i in range(len(prompts))
        )
        result = execute(ModelBatch(step, reqs))
        assert result.step_id == step
        assert result.request_ids == tuple(r.request_id for r in reqs)
        for i, tok in enumerate(result.token_ids):
            positions[i] += len(pending[i])
            pending[i] = (tok,)
            outputs[i].append(tok)
        step += 1
    return outputs
