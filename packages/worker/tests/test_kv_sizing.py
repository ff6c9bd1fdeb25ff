"""KV cache sizing arithmetic (``kv_sizing.plan_kv_cache``): an explicit count, an accelerator's fraction,
and on CPU the per-host budget that every stage of every engine on a host shares. Pure: no devices."""

import dataclasses

import pytest

from pipejax.runner.config import CacheConfig
from pipejax.worker.kv_sizing import GIB, plan_kv_cache

MIB = 1 << 20
# A stage whose block takes 1 MiB on each of its 2 devices: 2 MiB of host RAM per block on CPU.
STAGE = dict(device_bytes_per_block=MIB, tp_size=2, max_num_seqs=64, max_model_len=2048)
NEED = 1 + 64 * 2048 // 16  # 8,193 blocks: what 64 sequences of 2,048 tokens need
ROOMY = 200 * GIB  # host RAM available: enough that the default budget is not capped


def cpu(cache=CacheConfig(), available=ROOMY, **stage):
    return plan_kv_cache(cache, **{**STAGE, **stage}, device_free_bytes=None, host_available_bytes=available)


def test_cpu_default_budget_is_4_gib_per_host_shared_by_its_stages():
    assert cpu().num_blocks == 4 * GIB // (2 * MIB)  # 2,048 blocks: one stage alone on the host
    plan = cpu(stages_on_host=2)
    assert plan.num_blocks == 1024 and plan.source == "cpu_budget" and plan.budget_bytes == 4 * GIB
    assert plan.num_blocks * plan.stage_bytes_per_block * 2 == 4 * GIB  # both stages together: the budget


def test_cpu_budget_shared_by_the_stages_of_every_engine_on_the_host():
    """Two DP engines of two stages each on one host: four sharers, a quarter each."""
    plan = cpu(CacheConfig(engines_on_host=2), stages_on_host=2)
    assert plan.num_blocks == 512 and plan.sharers == 4
    assert "4 stages on this host (2 engines x 2)" in plan.describe()


def test_cpu_budget_flag_and_need():
    assert cpu(CacheConfig(cpu_kvcache_space=1), stages_on_host=2).num_blocks == 256
    assert cpu(CacheConfig(cpu_kvcache_space=0.5)).num_blocks == 256
    # a small need takes only what it needs, whatever the budget
    small = cpu(max_num_seqs=2, max_model_len=64, stages_on_host=2)
    assert small.num_blocks == small.need_blocks == 1 + 2 * 4


def test_cpu_default_budget_never_exceeds_half_the_available_ram():
    plan = cpu(available=2 * GIB, stages_on_host=2)  # half of 2 GiB: a 1 GiB budget, not 4
    assert plan.budget_bytes == GIB and plan.budget_capped_by_ram and plan.num_blocks == 256
    assert "50% of the 2.0 GiB available RAM" in plan.describe()
    # an explicit budget is the user's word, even past that share
    assert cpu(CacheConfig(cpu_kvcache_space=3), available=2 * GIB).num_blocks == 3 * GIB // (2 * MIB)


def test_budget_too_small_for_one_request_names_the_flag():
    # 100 MiB / 2 stages = 50 MiB = 25 blocks < 1 + 2,048 / 16 = 129 blocks for one max_model_len request
    with pytest.raises(ValueError, match=r"max_model_len=2048 needs \(129 blocks.*--cpu-kvcache-space / "
                                         r"PIPEJAX_CPU_KVCACHE_SPACE of at least 0\.51 GiB"):
        cpu(CacheConfig(cpu_kvcache_space=100 / 1024), stages_on_host=2)
    with pytest.raises(ValueError, match=r"default lowered to 50% of the host's 0\.2 GiB available RAM"):
        cpu(available=200 * MIB)
    cpu(CacheConfig(cpu_kvcache_space=258 * MIB / GIB))  # exactly one request's 129 blocks fit


def test_explicit_num_blocks_wins():
    plan = cpu(CacheConfig(num_blocks=7, cpu_kvcache_space=0.001), available=0)
    assert plan.num_blocks == 7 and plan.describe().endswith("set by --num-kv-blocks")
    on_device = plan_kv_cache(CacheConfig(num_blocks=7), **STAGE, device_free_bytes=0, host_available_bytes=0)
    assert on_device.num_blocks == 7


def test_explicit_memory_fraction_wins_over_the_cpu_budget():
    """--gpu-memory-utilization on CPU: that fraction of the available RAM, split among the host's stages."""
    plan = cpu(CacheConfig(memory_fraction=0.25, cpu_kvcache_space=1), available=800 * MIB, stages_on_host=2,
               max_model_len=256)
    assert plan.source == "cpu_fraction" and plan.num_blocks == 800 * MIB // 4 // 2 // (2 * MIB)  # 50
    assert "0.25 of the host's available RAM shared by 2 stages" in plan.describe()
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.25 .* raise it"):
        cpu(CacheConfig(memory_fraction=0.25), available=100 * MIB)  # 12 blocks < 129


def test_accelerator_keeps_the_fraction_of_free_device_memory():
    def device(cache=CacheConfig(), free=1000 * MIB):
        return plan_kv_cache(cache, **STAGE, device_free_bytes=free, host_available_bytes=0, stages_on_host=4)

    plan = device()  # default fraction 0.5 of each device's free memory, per-device blocks of 1 MiB
    assert plan.source == "device" and plan.memory_fraction == 0.5 and plan.num_blocks == 500
    assert device(CacheConfig(memory_fraction=0.9)).num_blocks == 900
    assert device(free=100 * GIB).num_blocks == NEED  # capped at what the limits need
    assert device(CacheConfig(cpu_kvcache_space=0.001)).num_blocks == 500  # the CPU budget plays no part
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        device(free=100 * MIB)


def test_one_line_describes_the_choice():
    line = cpu(stages_on_host=2).describe()
    assert line == (
        "KV cache: 1,024 blocks x 16 tokens (16,384 tokens), 2.00 GiB per stage, capped by the budget; "
        "CPU budget 4 GiB shared by 2 stages on this host (--cpu-kvcache-space / PIPEJAX_CPU_KVCACHE_SPACE)"
    )
    assert "\n" not in line
    small = cpu(max_num_seqs=1, max_model_len=64).describe()
    assert small.startswith("KV cache: 5 blocks x 16 tokens (80 tokens), 10.0 MiB per stage, what 1 sequence x "
                            "64 tokens need; CPU budget 4 GiB shared by 1 stage on this host")


def test_cache_config_refuses_bad_values():
    with pytest.raises(ValueError, match="cpu_kvcache_space=0 GiB must be > 0.*PIPEJAX_CPU_KVCACHE_SPACE"):
        CacheConfig(cpu_kvcache_space=0)
    with pytest.raises(ValueError, match="engines_on_host=0"):
        dataclasses.replace(CacheConfig(), engines_on_host=0)
    with pytest.raises(ValueError, match=r"memory_fraction=1.5 must be in \(0, 1\]"):
        CacheConfig(memory_fraction=1.5)


def test_the_vllm_host_reads_its_budget_from_pipejax_or_vllm_variables():
    from pipejax.worker.kv_sizing import cpu_kvcache_space_from_env

    assert cpu_kvcache_space_from_env({}) is None
    assert cpu_kvcache_space_from_env({"VLLM_CPU_KVCACHE_SPACE": "0"}) is None  # vLLM's "unset"
    assert cpu_kvcache_space_from_env({"VLLM_CPU_KVCACHE_SPACE": "2"}) == 2.0
    assert cpu_kvcache_space_from_env({"PIPEJAX_CPU_KVCACHE_SPACE": "1.5", "VLLM_CPU_KVCACHE_SPACE": "2"}) == 1.5
    with pytest.raises(ValueError, match="PIPEJAX_CPU_KVCACHE_SPACE='lots' is not a number of GiB"):
        cpu_kvcache_space_from_env({"PIPEJAX_CPU_KVCACHE_SPACE": "lots"})
