"""KV-cache operations a host engine drives: allocation after the weights, whole-block copies (a
host's copy-on-write), and the sampled token's rank among the logits."""

import jax
import numpy as np
import pytest
from hf_oracle import make_hf_checkpoint, prefill_batch

from pipejax.pp_utils import stage_mesh
from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
from pipejax.runner.config import CacheConfig, SchedulerConfig
from pipejax.runner.runner import StageRunner


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint(path, "LlamaForCausalLM", max_position_embeddings=64)
    limits = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    return StageRunner(path, stage_mesh(jax.devices()[:1]), cache=CacheConfig(num_blocks=None), scheduler=limits)


def test_cache_is_allocated_after_the_weights_and_blocks_copy_whole(runner):
    assert runner.kv_cache is None and runner.params is not None
    batch = prefill_batch([[1, 5, 9, 2, 7, 3]], blocks_per_request=4)
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        runner.execute(batch)
    runner.allocate_kv_cache(12)
    assert runner.kv_cache[0].shape[1] == 12
    runner.execute(batch)  # writes the request's K/V into its blocks 1.. (block 0 is padding)
    written = batch.requests[0].block_table[0]
    k, v = (np.asarray(c) for c in runner.kv_cache)
    assert np.abs(k[:, written]).sum() > 0
    runner.copy_blocks([(written, 9), (written, 10)])
    k2, v2 = (np.asarray(c) for c in runner.kv_cache)
    for dst in (9, 10):
        np.testing.assert_array_equal(k2[:, dst], k[:, written])
        np.testing.assert_array_equal(v2[:, dst], v[:, written])
    np.testing.assert_array_equal(k2[:, written], k[:, written])  # the source is left as it was


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0, logprobs=3),
                                      SamplingParams(temperature=5.0, seed=11, logprobs=3)], ids=["greedy", "sampled"])
def test_sampled_rank_counts_larger_logits(runner, sampling):
    if runner.kv_cache is None:
        runner.allocate_kv_cache(12)
    request = ScheduledRequest("r", (1, 5, 9), 0, (1,), sampling)
    logits = runner.logits(ModelBatch(7, (request,)))[0]
    out = runner.execute(ModelBatch(8, (request,)))
    token, lp = out.token_ids[0], out.logprobs[0]
    assert lp.rank == 1 + int((logits > logits[token]).sum())
    if sampling.greedy:
        assert lp.rank == 1 and lp.top[0][0] == token
