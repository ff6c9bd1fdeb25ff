"""Penalties, logit bias, ``min_tokens``, bad words and allowed token ids through the whole engine at pp=2 x tp=2,
greedy, token-identical to transformers on the same checkpoint: its own logits processors where it has them
(``repetition_penalty``, ``bad_words_ids``, ``min_new_tokens``, ``sequence_bias``), else its logits with vLLM's
formula applied in numpy (presence and frequency penalties, allowed token ids). A choice (structured outputs) is
checked against greedy over the tokens that keep the text the start of a choice, computed without a grammar
engine. All cases run in one engine, in one batch, next to plain requests that must get what they get alone."""

import pytest
from oracle import (
    choice_mask,
    hf_greedy_with,
    make_checkpoint,
    mixed_prompts,
    only,
    vllm_penalties,
    write_byte_tokenizer,
)

from pipejax.ray_executor import LLM, SamplingParams, StructuredOutputs

PROMPTS = mixed_prompts(4, seed=5)
NEW = 12
PLAIN = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
CHOICES = ["ab7", "a x", "zz9"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_checkpoint(path, "LlamaForCausalLM", seed=3)  # a seed whose greedy outputs vary
    texts = write_byte_tokenizer(path)  # one token per byte: the grammar's tokens are characters
    llm = LLM(str(path), pipeline_parallel_size=2, tensor_parallel_size=2, block_size=8, num_kv_blocks=200,
              warmup=False)
    yield llm, model, texts
    llm.shutdown()


def test_every_adjustment_matches_transformers_in_one_mixed_batch(setup):
    llm, model, texts = setup
    plain = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PLAIN)]
    first = plain[0]
    assert first == hf_greedy_with(model, PROMPTS[0], NEW)
    stop, pair = first[1], (first[2], first[3])
    assert first[2] not in (p[-1] for p in PROMPTS)  # transformers' bad words also look at the prompt; vLLM's not
    cases = {  # name: (pipejax's parameters, transformers' equivalent)
        "repetition": ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        "bias": ({"logit_bias": {first[0]: -100.0, first[4]: 7.5}},
                 {"sequence_bias": {(first[0],): -100.0, (first[4],): 7.5}}),
        "bad word": ({"bad_words_token_ids": ((first[5],),)}, {"bad_words_ids": [[first[5]]]}),
        "bad pair": ({"bad_words_token_ids": (pair,)}, {"bad_words_ids": [list(pair)]}),
        "min_tokens": ({"min_tokens": 6, "stop_token_ids": (stop,)}, {"min_new_tokens": 6, "stop": stop}),
        "presence+frequency": ({"presence_penalty": 1.5, "frequency_penalty": 0.7},
                               {"adjust": vllm_penalties(1.5, 0.7)}),
        "allowed": ({"allowed_token_ids": (first[3], 7, 11, 50)}, {"adjust": only([first[3], 7, 11, 50])}),
        "choice": ({"structured_outputs": StructuredOutputs(choice=CHOICES)}, {"adjust": choice_mask(CHOICES, texts)}),
    }
    prompts, params, expected = [], [], []
    for ours, theirs in cases.values():
        for prompt in PROMPTS:
            prompts.append({"prompt_token_ids": prompt})
            params.append(SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **ours))
            want = hf_greedy_with(model, prompt, NEW, **theirs)
            if "structured_outputs" in ours:  # the request ends where its text completes a choice
                want = want[:next(n for n in range(NEW) if "".join(texts[t] for t in want[:n]) in CHOICES)]
            expected.append(want)
        prompts.append({"prompt_token_ids": PROMPTS[1]})  # a plain request next to each case's
        params.append(PLAIN)
        expected.append(plain[1])
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    names = [name for name in cases for _ in range(len(PROMPTS) + 1)]
    mismatched = [(n, g, e) for n, g, e in zip(names, got, expected, strict=True) if g != e]
    assert not mismatched, mismatched
    # each case changed prompt 0's output, so each comparison could have failed
    row0 = {name: got[k * (len(PROMPTS) + 1)] for k, name in enumerate(cases)}
    assert all(out != first for out in row0.values()), row0
    constrained = [k for k, n in enumerate(names) if n == "choice" and k % (len(PROMPTS) + 1) < len(PROMPTS)]
    chosen = {"".join(texts[t] for t in got[k]) for k in constrained}
    assert chosen <= set(CHOICES) and len(chosen) > 1, chosen  # the model's logits picked, not the grammar
    assert row0["bad pair"][:3] == first[:3] and row0["bad pair"][3] != first[3]  # banned after its first token
    assert len(row0["min_tokens"]) >= 6 and stop not in row0["min_tokens"][:6]  # plain stops at token 2


def test_logprobs_minus_one_is_the_whole_vocabulary_as_transformers_computes_it(setup):
    """``logprobs=-1`` (vLLM's meaning): every token's raw logprob at each generated position, best first, equal to
    transformers' log-softmax on the same checkpoint (pp=2 x tp=2), next to a request asking for 2."""
    import torch

    llm, model, _ = setup
    prompt = PROMPTS[2]
    whole, two = llm.generate([{"prompt_token_ids": prompt}] * 2,
                              [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1),
                               SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)])
    tokens = list(whole.outputs[0].token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    expected = torch.log_softmax(logits, dim=-1).numpy()
    vocab = expected.shape[1]
    for pos, (lp, lp2) in enumerate(zip(whole.outputs[0].logprobs, two.outputs[0].logprobs, strict=True)):
        ids = [t for t, _ in lp.top]
        assert len(ids) == vocab and sorted(ids) == list(range(vocab)), pos
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and lp.rank == 1 and lp.top[0][0] == tokens[pos]
        assert max(abs(v - expected[pos, t]) for t, v in lp.top) < 1e-4, pos
        assert lp2.top == lp.top[:2]  # the same distribution, cut at 2


def test_prompt_logprobs_are_transformers_log_softmax_over_the_prompt(setup):
    """``prompt_logprobs=3`` (vLLM's meaning): None for the first prompt token, then each token's raw logprob given
    those before it, its rank and the top 3, equal to transformers' (pp=2 x tp=2), beside a request asking for none
    (which then gets None, and the same tokens as alone)."""
    from pipejax_test_support import hf_prompt_logprobs

    llm, model, _ = setup
    prompts = [PROMPTS[0], PROMPTS[3]]
    asked, plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
                                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert plain.prompt_logprobs is None
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4,
                                                                              ignore_eos=True))[0]
    assert asked.outputs[0].token_ids == alone.outputs[0].token_ids
    got = asked.prompt_logprobs
    assert len(got) == len(prompts[0]) and got[0] is None
    for lp, (logprob, rank, top) in zip(got[1:], hf_prompt_logprobs(model, prompts[:1], 3)[0], strict=True):
        assert abs(lp.sampled - logprob) < 1e-4 * max(1.0, abs(logprob))
        assert lp.rank == rank and [t for t, _ in lp.top] == top
