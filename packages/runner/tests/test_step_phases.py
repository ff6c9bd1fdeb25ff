"""A step's public phases (``prepare_inputs`` -> ``forward`` -> ``sample``) are ``execute`` split up:
what benchmarks time part by part is what serving runs."""

import jax
import numpy as np
from hf_oracle import make_hf_checkpoint, prefill_batch

from pipejax.pp_utils import stage_mesh
from pipejax.runner.config import CacheConfig, SchedulerConfig
from pipejax.runner.runner import StageRunner


def test_phases_equal_execute(tmp_path):
    make_hf_checkpoint(tmp_path, "LlamaForCausalLM", max_position_embeddings=64)
    cache, limits = CacheConfig(num_blocks=32), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    whole, parts = (
        StageRunner(tmp_path, stage_mesh(jax.devices()[:1]), cache=cache, scheduler=limits) for _ in range(2)
    )
    batch = prefill_batch([[1, 5, 9, 2], [7, 3]], blocks_per_request=4)

    expected = whole.execute(batch)
    shape, inputs = parts.prepare_inputs(batch)
    assert shape == whole.step_shape(batch) and shape in whole.compiled_shapes
    logits = parts.forward(inputs, shape)
    assert logits.shape == (shape.rows, parts.cfg.vocab_size)
    got = parts.sample(batch, logits, shape.rows)
    assert got == expected and len(got.token_ids) == 2
    np.testing.assert_array_equal(np.asarray(parts.kv_cache[0]), np.asarray(whole.kv_cache[0]))  # same cache writes
