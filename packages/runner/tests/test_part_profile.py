"""``part_profile``: a model's parts from the step times of one- and two-layer stages (the arithmetic exact on given
times, a MoE model's kinds apart), interpolated between batch sizes, and measured end to end on the built-in
model's real stages; bad input refused by name."""

import dataclasses

import jax
import pytest

from pipejax.runner.builtin_model import ensure_builtin_model
from pipejax.runner.config import ModelConfig, MoeConfig
from pipejax.runner.part_profile import PartProfile, PartTimes, _parts_at, layer_kinds, profile_parts

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 320}


def test_parts_are_the_differences_of_the_stages_step_times():
    model = ModelConfig.from_hf(LLAMA)
    layer, overhead, embed, head = 3e-3, 1e-3, 0.2e-3, 5e-3
    times = {"first1": overhead + embed + layer, "first2": overhead + embed + 2 * layer,
             "middle-dense": overhead + layer, "last1": overhead + layer + head}
    part = _parts_at(8, {k: (v, 1.5) for k, v in times.items()}, layer_kinds(model), {"dense": 1}, model)
    assert part.layer_s == pytest.approx((layer,) * 6)
    assert (part.first_s, part.last_s, part.overhead_s) == pytest.approx((embed, head, overhead))
    assert part.busy_cores == 1.5
    # a stage's step: its fixed cost, its layers, and its end parts
    assert part.stage_s(0, 6, 1, 0) == pytest.approx(overhead + embed + 6 * layer + head)
    assert part.stage_s(2, 4, 3, 1) == pytest.approx(overhead + 2 * layer)


def test_a_stages_cores_are_its_parts_cpu_time_over_their_time():
    model = ModelConfig.from_hf(LLAMA)
    # a layer keeps 2 cores busy, the fixed cost and the ends 1
    layer, overhead, embed, head = 3e-3, 1e-3, 0.2e-3, 5e-3
    wall = {"first1": overhead + embed + layer, "first2": overhead + embed + 2 * layer,
            "middle-dense": overhead + layer, "last1": overhead + layer + head}
    cpu = {"first1": overhead + embed + 2 * layer, "first2": overhead + embed + 4 * layer,
           "middle-dense": overhead + 2 * layer, "last1": overhead + 2 * layer + head}
    part = _parts_at(8, {k: (wall[k], cpu[k] / wall[k]) for k in wall}, layer_kinds(model), {"dense": 1}, model)
    assert part.cpu.layer_s == pytest.approx((2 * layer,) * 6)
    assert (part.cpu.first_s, part.cpu.last_s, part.cpu.overhead_s) == pytest.approx((embed, head, overhead))
    whole = overhead + embed + 12 * layer + head
    assert part.stage_cores(0, 6, 1, 0) == pytest.approx(whole / part.stage_s(0, 6, 1, 0))
    assert part.stage_cores(2, 4, 3, 1) == pytest.approx((overhead + 4 * layer) / (overhead + 2 * layer))
    # a middle stage of four layers keeps more cores busy than the one-layer middle stage measured
    assert part.stage_cores(1, 5, 3, 1) == pytest.approx(25 / 13)
    assert part.stage_cores(1, 5, 3, 1) > cpu["middle-dense"] / wall["middle-dense"]
    # interpolated between batch sizes with the times
    profile = PartProfile(1, 64, (part, dataclasses.replace(part, rows=16)), "test")
    assert profile.at(12).stage_cores(0, 6, 1, 0) == pytest.approx(part.stage_cores(0, 6, 1, 0))


def test_a_moe_models_layer_kinds_are_timed_apart():
    moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, sparse_step=2)
    model = dataclasses.replace(ModelConfig.from_hf(LLAMA), moe=moe)
    kinds = layer_kinds(model)
    assert kinds == ("dense", "moe") * 3  # layer i is sparse where (i + 1) % 2 == 0
    dense, sparse, overhead = 2e-3, 7e-3, 1e-3
    times = {"first1": overhead + dense, "first2": overhead + dense + sparse, "middle-moe": overhead + sparse,
             "middle-dense": overhead + dense, "last1": overhead + sparse + 4e-3}
    part = _parts_at(8, {k: (v, 1.0) for k, v in times.items()}, kinds, {"dense": 2, "moe": 1}, model)
    assert part.layer_s == pytest.approx((dense, sparse) * 3)
    assert part.last_s == pytest.approx(4e-3) and part.first_s == pytest.approx(0.0)


def test_between_batch_sizes_the_parts_are_interpolated_and_beyond_them_extended():
    def at(rows, layer):
        return PartTimes(rows, (layer, layer), 0.0, 2 * layer, 1e-3, 1.0)

    profile = PartProfile(1, 64, (at(1, 1.0), at(16, 2.5), at(64, 7.3)), "test")
    assert profile.at(16).layer_s == (2.5, 2.5)
    assert profile.at(40).layer_s[0] == pytest.approx(2.5 + (7.3 - 2.5) / 2)
    assert profile.at(8).last_s == pytest.approx(2 * (1.0 + 1.5 * 7 / 15))
    assert profile.at(128).layer_s[0] == pytest.approx(7.3 + 64 * 4.8 / 48)


def test_the_built_in_models_parts_measured_on_its_own_stages(tmp_path):
    path = ensure_builtin_model("default", tmp_path)
    model = ModelConfig.from_pretrained(path)
    profile = profile_parts(path, model, tp=2, rows=[1, 4], context=40, repeats=2)
    assert profile.tp == 2 and [p.rows for p in profile.measured] == [1, 4]
    for part in profile.measured:
        assert len(part.layer_s) == model.num_layers
        assert part.stage_s(0, model.num_layers, 1, 0) > 0 and part.busy_cores > 0
        assert min(part.layer_s) >= 0 and part.first_s >= 0 and part.last_s >= 0
    assert "tp=2" in profile.source


def test_bad_input_is_refused_by_name(tmp_path):
    path = ensure_builtin_model("default", tmp_path)
    model = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        profile_parts(path, model, tp=len(jax.devices()) + 1, rows=[1], context=8)
    with pytest.raises(ValueError, match="needs >= 3"):
        profile_parts(path, dataclasses.replace(model, num_layers=2), tp=1, rows=[1], context=8)
