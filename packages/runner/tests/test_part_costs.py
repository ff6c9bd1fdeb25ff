"""``--pp-layer-partition auto``: the modelled part costs, and the split each stage derives from them."""

import dataclasses

from pipejax.runner.config import ModelConfig, StageConfig, auto_partition

SMOLLM2_135M = ModelConfig(  # SmolLM2-135M-Instruct's config.json, as from_hf converts it
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def test_smollm2_parts_cost_what_their_weights_hold():
    costs = SMOLLM2_135M.part_costs()
    assert costs.layer_time[0] == 3_538_944 + 2 * 576  # q, k, v, o, gate, up, down; two norms: 3.54M parameters
    assert costs.last_time == 49152 * 576 + 576  # the tied LM head (28.3M) and the final norm
    assert costs.first_time == 0 and costs.first_bytes == 49152 * 576 * 4  # a lookup: memory, no time
    bf16 = dataclasses.replace(SMOLLM2_135M, dtype="bfloat16").part_costs()
    assert bf16.layer_bytes[0] == costs.layer_bytes[0] / 2
    # weights kept quantized: the projections and the table in their format, the norms in float32
    int4 = dataclasses.replace(SMOLLM2_135M, quantization="int4").part_costs()
    assert int4.layer_bytes[0] == 3_538_944 * (0.5 + 4 / 32) + 2 * 576 * 4
    assert int4.last_bytes == 49152 * 576 * (1 + 4 / 32) + 576 * 4 and int4.layer_time == costs.layer_time
    assert dataclasses.replace(SMOLLM2_135M, quantization="int8").part_costs().first_bytes == 49152 * 576


def test_auto_gives_the_head_stage_fewer_layers_and_every_stage_agrees():
    assert auto_partition(SMOLLM2_135M, 2) == (19, 11)  # the head weighs ~8 layers
    counts = auto_partition(SMOLLM2_135M, 4)
    assert sum(counts) == 30 and counts[-1] < min(counts[:-1])
    ranges = [StageConfig(r, 4, "auto").layer_range(SMOLLM2_135M) for r in range(4)]
    assert [len(r) for r in ranges] == list(counts) and ranges[0].start == 0 and ranges[-1].stop == 30
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:], strict=False))
