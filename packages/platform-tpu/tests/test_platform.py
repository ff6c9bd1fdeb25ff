"""``TpuPlatform``: free to construct, modes, check_and_update_config and plan."""

from __future__ import annotations

import dataclasses

import pytest

from pipejax.platform_tpu import Hardware, LayoutError, TpuNotFoundError, TpuPlatform, detect_host, tpu_present
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


@pytest.mark.skipif(tpu_present(), reason="this host has TPUs")
def test_tpu_mode_without_tpu_fails_clearly():
    platform = TpuPlatform(environ={"PIPEJAX_PLATFORM": "tpu"}, jax_fallback=False)
    with pytest.raises(TpuNotFoundError, match="PIPEJAX_PLATFORM=cpu"):
        platform.check_and_update_config(ParallelConfig())


# --- the per-host decision (what the Ray executor asks on each stage's node) ---------------------------

V5E_HOST_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}


def test_each_host_decides_what_it_has(tmp_path):
    roots = {"sys_root": str(tmp_path / "sys"), "dev_root": str(tmp_path / "dev")}  # no PCI ids, no chips
    assert detect_host(None, V5E_HOST_ENV, **roots).describe() == "1 TPU v5e host x 8 chips x 1 core = 8 devices"
    assert detect_host(None, {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}, **roots).platform == "cpu"
    assert detect_host("cpu", V5E_HOST_ENV, **roots).platform == "cpu"  # asked for: CPU even on a TPU host
    with pytest.raises(TpuNotFoundError, match="JAX fallback was off"):  # never opens a chip to find out
        detect_host("tpu", {}, **roots)


def test_requested_mode_is_what_was_asked_not_what_was_found():
    platform = TpuPlatform(environ={})
    assert platform.is_simulated() and platform.requested_mode is None  # a CPU driver does not decide for others
    assert TpuPlatform(environ={"PIPEJAX_PLATFORM": "CPU"}).requested_mode == "cpu"
    assert TpuPlatform("tpu", environ={}).requested_mode == "tpu"


def test_stage_environment_takes_granted_chips_of_a_whole_box():
    platform = TpuPlatform(environ={})
    v5e = Hardware("tpu", 1, 8, generation="v5e")
    env = platform.stage_environment(v5e, (4, 5, 6, 7), 4)
    assert env["JAX_PLATFORMS"] == "tpu,cpu" and env["TPU_VISIBLE_CHIPS"] == "4,5,6,7"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1" and env["TPU_PROCESS_PORT"] == "8480"
    for chips in [(2, 3, 4, 5), (0, 1, 2), (0, 1, 3, 4), (6, 7, 8, 9), ()]:
        with pytest.raises(LayoutError, match=r"needs 4 consecutive chips starting at a multiple of 4.*granted"):
            platform.stage_environment(v5e, chips, 4)
    v7x = Hardware("tpu", 1, 4, generation="v7x")  # 2 devices per chip: tp=4 is 2 chips
    assert platform.stage_environment(v7x, (2, 3), 4)["TPU_VISIBLE_CHIPS"] == "2,3"
    cpu = platform.stage_environment(Hardware("cpu"), (2, 3), 2)
    assert cpu == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def test_hosts_as_ray_lists_them():
    node = {"TPU": 8.0, "accelerator_type:TPU-V5LITEPOD": 1.0, "CPU": 8.0}
    assert TpuPlatform.ray_node_hardware(node) == Hardware("tpu", 1, 8, generation="v5e")
    assert TpuPlatform.ray_node_hardware({"TPU": 4.0, "accelerator_type:TPU-V7X": 1.0}).cores_per_chip == 2
    assert TpuPlatform.ray_node_hardware({"TPU": 8.0}) is None  # chips, but no generation
    assert TpuPlatform.ray_node_hardware({"CPU": 8.0, "accelerator_type:A100": 1.0}) is None
    heads = {"TPU-v5litepod-16-head": 1.0, "TPU-v5litepod-8-head": 1.0, "TPU-v4-16-head": 1.0, "TPU-v4-8-head": 1.0}
    assert TpuPlatform.ray_slice_heads(heads) == ["TPU-v4-16-head", "TPU-v5litepod-16-head"]  # multi-host only


def test_engine_processes_get_disjoint_boxes():
    tpu = TpuPlatform(environ=V5E_HOST_ENV, jax_fallback=False)
    config = ParallelConfig(1, 4, 2, distributed_executor_backend="uni")
    envs = [tpu.engine_environment(config, i, 2) for i in range(2)]
    assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == ["0,1,2,3", "4,5,6,7"]
    assert all(e["JAX_PLATFORMS"] == "tpu,cpu" for e in envs)
    with pytest.raises(LayoutError, match="needs 2 hosts"):
        tpu.engine_environment(config, 0, 3)  # a third engine of 4 chips does not fit this host
    ray_engine = tpu.engine_environment(dataclasses.replace(config, distributed_executor_backend="ray"), 1, 2)
    assert ray_engine == {"JAX_PLATFORMS": "cpu"}  # its stages own the chips
    cpu = TpuPlatform(environ={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert cpu.engine_environment(config, 1, 2)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_driver_environment_never_forces_cpu_on_an_engine_that_owns_chips():
    tpu = TpuPlatform(environ=V5E_HOST_ENV, jax_fallback=False)
    uni = tpu.driver_environment(2, 2, None)
    assert uni["JAX_PLATFORMS"] == "tpu,cpu" and uni["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
    assert tpu.driver_environment(2, 8, None) == {"JAX_PLATFORMS": "cpu"}  # spans hosts: Ray, the stages own chips
    assert tpu.driver_environment(1, 1, "ray") == {"JAX_PLATFORMS": "cpu"}
