"""Greedy outputs of the torchax path token-identical to transformers' ``generate`` (the native JAX path
is held to the same oracle by the runner's tests): Llama on pp in {1, 2} x tp in {1, 2}, Qwen2 (q/k/v
biases split over TP) at pp2 tp2, on checkpoints saved by transformers."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from bridge_helpers import PROMPTS, ChainedStages, greedy_generate, hf_greedy, make_hf_checkpoint, prefill_batch

MAX_NEW_TOKENS = 6
CASES = [("LlamaForCausalLM", 1, 1), ("LlamaForCausalLM", 1, 2), ("LlamaForCausalLM", 2, 1),
         ("LlamaForCausalLM", 2, 2), ("Qwen2ForCausalLM", 2, 2)]  # not the product: 13-19 s each, cold (2 CPUs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (path, the transformers model, its greedy outputs), each made once."""

    @functools.cache
    def get(arch: str):
        path = tmp_path_factory.mktemp(arch)
        model = make_hf_checkpoint(path, arch)
        return path, model, hf_greedy(model, PROMPTS, MAX_NEW_TOKENS)

    return get


@pytest.mark.parametrize("arch,pp,tp", CASES, ids=[f"{a[:5].lower()}-pp{pp}-tp{tp}" for a, pp, tp in CASES])
def test_greedy_matches_transformers(checkpoints, arch, pp, tp):
    path, _, expected = checkpoints(arch)
    assert greedy_generate(ChainedStages(path, pp, tp, "torchax"), PROMPTS, MAX_NEW_TOKENS) == expected


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_prefill_logits_match_transformers(checkpoints, arch):
    path, model, _ = checkpoints(arch)
    logits = ChainedStages(path, 2, 2, "torchax").logits(prefill_batch(PROMPTS))
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS]
    np.testing.assert_allclose(logits[: len(PROMPTS)], np.stack(ref), atol=2e-5, rtol=0)


def test_tied_embeddings_and_replicated_kv_heads(tmp_path):
    """The last stage loads its LM head from the embedding; tp=4 > 2 KV heads replicates them."""
    model = make_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", seed=1, tie_word_embeddings=True)
    expected = hf_greedy(model, PROMPTS, MAX_NEW_TOKENS)
    assert greedy_generate(ChainedStages(tmp_path, 2, 4, "torchax"), PROMPTS, MAX_NEW_TOKENS) == expected
