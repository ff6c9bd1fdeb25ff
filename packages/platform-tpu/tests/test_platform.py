"""``TpuPlatform``: free to construct, modes, check_and_update_config and plan."""

from __future__ import annotations

import pytest

from pipejax.platform_tpu import Hardware, LayoutError, TpuNotFoundError, TpuPlatform, tpu_present
from pipejax.pp_utils import ParallelConfig


def test_construction_detects_nothing():
    platform = TpuPlatform(environ={"PIPEJAX_PLATFORM": "gpu"})  # a bad mode surfaces on first use only
    assert platform._hardware is None and "not detected yet" in repr(platform)
    with pytest.raises(ValueError, match="'gpu' is not a platform mode"):
        _ = platform.mode


def test_cpu_development_mode():
    env = {"PIPEJAX_PLATFORM": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    platform = TpuPlatform(environ=env)
    assert platform.mode == "cpu" and platform.is_simulated() and not platform.is_tpu()
    assert platform.devices_per_host() == 4 and platform.cores_per_chip() == 1
    assert platform.ray_device_key == "" and platform.device_type == "tpu"
    assert platform.get_device_name() == "CPU (simulated devices)"
    config = ParallelConfig(2, 2)
    checked = platform.check_and_update_config(config)
    assert checked.distributed_executor_backend == "uni" and config.distributed_executor_backend is None
    plan = platform.plan(config)
    assert plan.parallel == checked
    assert plan.stage(0, 1).env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    with pytest.raises(LayoutError, match="pipeline_parallel_size <= 2"):
        platform.check_and_update_config(ParallelConfig(3, 2))


def test_num_hosts_override_lets_ray_span_cpu_hosts():
    platform = TpuPlatform("cpu", num_hosts=2, environ={})
    plan = platform.plan(ParallelConfig(3, 4))
    assert plan.backend == "ray" and [s.host for s in plan.stages] == [0, 0, 1]


def test_tpu_mode_with_given_hardware():
    platform = TpuPlatform(hardware=Hardware("tpu", 1, 4, 2, "v3"))
    assert platform.is_tpu() and platform.ray_device_key == "TPU"
    assert platform.get_device_name() == "TPU v3" and platform.devices_per_host() == 8
    plan = platform.plan(ParallelConfig(4, 2))
    assert [s.env["TPU_VISIBLE_CHIPS"] for s in plan.stages] == ["0", "1", "2", "3"]
    assert plan.worker_cls == TpuPlatform.worker_cls == "pipejax.worker.StageWorker"


@pytest.mark.skipif(tpu_present(), reason="this host has TPUs")
def test_tpu_mode_without_tpu_fails_clearly():
    platform = TpuPlatform(environ={"PIPEJAX_PLATFORM": "tpu"}, jax_fallback=False)
    with pytest.raises(TpuNotFoundError, match="PIPEJAX_PLATFORM=cpu"):
        platform.check_and_update_config(ParallelConfig())
