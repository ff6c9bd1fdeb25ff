"""Prompt logprobs against transformers' log-softmax, fp32: prompts prefilled in chunks at pp=2 x tp=2 (the
tied head sharded by vocabulary) and on one CPU device (the LM head in panels), beside a request that asks for
none; each prompt token's logprob within 1e-4, its rank and its top 5 equal."""

import numpy as np
import pytest
from hf_oracle import ChainedStages, make_hf_checkpoint
from pipejax_test_support import hf_prompt_logprobs

from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 45)), [3, 4, 7]]
CHUNK = 6
TOP = 5


def _chunks(prompts, asks):
    """The steps that prefill ``prompts`` CHUNK tokens at a time, each chunk naming the prompt tokens that follow
    its tokens where the request ``asks`` for prompt logprobs."""
    steps, done = [], [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        reqs = []
        for i, p in enumerate(prompts):
            if done[i] == len(p):
                continue
            todo = p[done[i]:done[i] + CHUNK]
            end = done[i] + len(todo)
            sampling = SamplingParams(temperature=0, prompt_logprobs=TOP if asks[i] else None)
            reqs.append(ScheduledRequest(f"r{i}", tuple(todo), done[i], tuple(range(1 + 8 * i, 9 + 8 * i)), sampling,
                                         sample=end == len(p),
                                         prompt_targets=tuple(p[done[i] + 1:end + 1]) if asks[i] else None))
            done[i] = end
        steps.append(ModelBatch(len(steps), tuple(reqs)))
    return steps


@pytest.mark.parametrize("pp,tp", [(2, 2), (1, 1)])
def test_prompt_logprobs_match_transformers(tmp_path, pp, tp):
    model = make_hf_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=tp > 1)
    stages = ChainedStages(tmp_path, pp, tp, num_blocks=40)
    asks = [True, True, False]
    got: dict[str, list] = {}
    for step in _chunks(PROMPTS, asks):
        out = stages.execute(step)
        assert {rid for rid, _ in out.prompt_logprobs} == {r.request_id for r in step.requests if r.prompt_targets}
        for rid, chunk in out.prompt_logprobs:
            got.setdefault(rid, []).extend(chunk)
    want = hf_prompt_logprobs(model, PROMPTS, TOP)
    assert sorted(got) == ["r0", "r1"]
    for i in (0, 1):
        have = got[f"r{i}"]
        assert len(have) == len(PROMPTS[i]) - 1
        for lp, (logprob, rank, top) in zip(have, want[i], strict=True):
            assert abs(lp.sampled - logprob) < 1e-4 * max(1.0, abs(logprob))
            assert lp.rank == rank and [t for t, _ in lp.top] == top
            assert np.all(np.diff([v for _, v in lp.top]) <= 0)  # best first
