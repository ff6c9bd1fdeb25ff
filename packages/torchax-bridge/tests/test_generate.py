"""Greedy outputs of the torchax path: token-identical to the native JAX path and to transformers'
``generate``, for pp in {1, 2} x tp in {1, 2}, on Llama and Qwen2 checkpoints saved by transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bridge_helpers import PROMPTS, ChainedStages, greedy_generate, hf_greedy, make_hf_checkpoint, prefill_batch

MAX_NEW_TOKENS = 6
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def checkpoint(request, tmp_path_factory):
    """(path, the transformers model, its greedy outputs)."""
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_checkpoint(path, request.param)
    return path, model, hf_greedy(model, PROMPTS, MAX_NEW_TOKENS)


@pytest.mark.parametrize("pp,tp", LAYOUTS, ids=[f"pp{pp}-tp{tp}" for pp, tp in LAYOUTS])
def test_greedy_matches_native_and_transformers(checkpoint, pp, tp):
    path, _, expected = checkpoint
    native = greedy_generate(ChainedStages(path, pp, tp, "jax"), PROMPTS, MAX_NEW_TOKENS)
    got = greedy_generate(ChainedStages(path, pp, tp, "torchax"), PROMPTS, MAX_NEW_TOKENS)
    assert got == native
    assert got == expected


def test_prefill_logits_match_transformers(checkpoint):
    path, model, _ = checkpoint
    logits = ChainedStages(path, 2, 2, "torchax").logits(prefill_batch(PROMPTS))
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS]
    np.testing.assert_allclose(logits[: len(PROMPTS)], np.stack(ref), atol=2e-5, rtol=0)


def test_tied_embeddings_and_replicated_kv_heads(tmp_path):
    """The last stage loads its LM head from the embedding; tp=4 > 2 KV heads replicates them."""
    model = make_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", seed=1, tie_word_embeddings=True)
    expected = hf_greedy(model, PROMPTS, MAX_NEW_TOKENS)
    assert greedy_generate(ChainedStages(tmp_path, 2, 4, "torchax"), PROMPTS, MAX_NEW_TOKENS) == expected
