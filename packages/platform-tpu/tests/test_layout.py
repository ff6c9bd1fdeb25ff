"""Layouts -> placements and process environments, and the errors for layouts that do not fit."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pipejax.platform_tpu import TPU_PORT_BASE, Hardware, LayoutError, check_layout, plan_layout
from pipejax.pp_utils import ParallelConfig

CPU8 = Hardware("cpu", chips_per_host=8)
V5E = Hardware("tpu", 1, 8, 1, "v5e")  # 8 chips, 1 core each
V5E_2 = dataclasses.replace(V5E, num_hosts=2)
V4 = Hardware("tpu", 1, 4, 1, "v4")  # 4 megacore chips
V4_2 = dataclasses.replace(V4, num_hosts=2)
V3 = Hardware("tpu", 1, 4, 2, "v3")  # 4 chips, 2 cores (JAX devices) each
V7X = Hardware("tpu", 1, 4, 2, "v7x")


def cfg(pp=1, tp=1, dp=1, backend=None) -> ParallelConfig:
    return ParallelConfig(pp, tp, dp, distributed_executor_backend=backend)


# hardware, config, chosen backend, per stage (dp-major): (host, chips, TPU_CHIPS_PER_PROCESS_BOUNDS)
TPU_TABLE = [
    pytest.param(V5E, cfg(2, 4), "uni", [(0, "0,1,2,3", "2,2,1"), (0, "4,5,6,7", "2,2,1")], id="v5e-pp2-tp4"),
    pytest.param(V5E, cfg(4, 2), "uni", [(0, f"{2*i},{2*i+1}", "1,2,1") for i in range(4)], id="v5e-pp4-tp2"),
    pytest.param(V5E, cfg(1, 8), "uni", [(0, "0,1,2,3,4,5,6,7", "2,4,1")], id="v5e-tp8-whole-host"),
    pytest.param(V5E, cfg(1, 1, 8), "uni", [(0, str(i), "1,1,1") for i in range(8)], id="v5e-dp8"),
    pytest.param(
        V5E, cfg(3, 1, 2), "uni",
        [(0, "0", "1,1,1"), (0, "1", "1,1,1"), (0, "2", "1,1,1"),  # engine 0 owns box 0-3
         (0, "4", "1,1,1"), (0, "5", "1,1,1"), (0, "6", "1,1,1")],  # engine 1 owns box 4-7
        id="v5e-pp3-dp2-boxes",
    ),
    pytest.param(V4, cfg(2, 2), "uni", [(0, "0,1", "1,2,1"), (0, "2,3", "1,2,1")], id="v4-megacore-pp2-tp2"),
    pytest.param(V4, cfg(1, 4), "uni", [(0, "0,1,2,3", "2,2,1")], id="v4-tp4"),
    pytest.param(V3, cfg(2, 2), "uni", [(0, "0", "1,1,1"), (0, "1", "1,1,1")], id="v3-2cores-tp2-one-chip"),
    pytest.param(V3, cfg(1, 8), "uni", [(0, "0,1,2,3", "2,2,1")], id="v3-tp8-four-chips"),
    pytest.param(V3, cfg(2, 1), "uni", [(0, "0", "1,1,1"), (0, "1", "1,1,1")], id="v3-tp1-half-chip"),
    pytest.param(V7X, cfg(2, 4), "uni", [(0, "0,1", "1,2,1"), (0, "2,3", "1,2,1")], id="v7x-tp4-two-chips"),
    pytest.param(
        V5E_2, cfg(3, 4), "ray", [(0, "0,1,2,3", "2,2,1"), (0, "4,5,6,7", "2,2,1"), (1, "0,1,2,3", "2,2,1")],
        id="v5e-2hosts-pp3-tp4-ray",
    ),
    pytest.param(
        V4_2, cfg(2, 4), "ray", [(0, "0,1,2,3", "2,2,1"), (1, "0,1,2,3", "2,2,1")], id="v4-2hosts-stage-per-host"
    ),
    pytest.param(
        V4_2, cfg(4, 1, 2), "uni", [(e, str(i), "1,1,1") for e in range(2) for i in range(4)],
        id="v4-2hosts-engine-per-host",
    ),
    pytest.param(V5E, cfg(2, 2, backend="ray"), "ray", [(0, "0,1", "1,2,1"), (0, "2,3", "1,2,1")], id="ray-asked"),
]


@pytest.mark.parametrize("hw, config, backend, expected", TPU_TABLE)
def test_tpu_layout_table(hw, config, backend, expected):
    plan = plan_layout(config, hw)
    assert plan.backend == backend
    assert [(s.dp_rank, s.pp_rank) for s in plan.stages] == [
        (d, p) for d in range(config.data_parallel_size) for p in range(config.pipeline_parallel_size)
    ]
    got = [(s.host, s.env["TPU_VISIBLE_CHIPS"], s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"]) for s in plan.stages]
    assert got == expected
    for s in plan.stages:
        port = TPU_PORT_BASE + s.chips[0]
        assert s.env["TPU_PROCESS_BOUNDS"] == "1,1,1"
        assert s.env["TPU_PROCESS_PORT"] == str(port)
        assert s.env["TPU_PROCESS_ADDRESSES"] == f"localhost:{port}"
        assert s.env["CLOUD_TPU_TASK_ID"] == "0"
        assert s.env["TPU_CHIPS_PER_HOST_BOUNDS"] == s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"]
        assert ("ALLOW_MULTIPLE_LIBTPU_LOAD" in s.env) == (len(s.chips) < hw.chips_per_host)
        assert len(s.chips) * hw.cores_per_chip >= config.tensor_parallel_size


def test_engine_env_in_process_and_under_ray():
    uni = plan_layout(cfg(2, 2, 2), V5E)
    assert [e.env["TPU_VISIBLE_CHIPS"] for e in uni.engines] == ["0,1,2,3", "4,5,6,7"]
    assert [e.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in uni.engines] == ["2,2,1", "2,2,1"]
    assert [e.env["TPU_PROCESS_PORT"] for e in uni.engines] == ["8476", "8480"]
    whole = plan_layout(cfg(1, 8), V5E).engine(0)
    assert whole.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,4,1" and "ALLOW_MULTIPLE_LIBTPU_LOAD" not in whole.env
    ray = plan_layout(cfg(3, 4), V5E_2)
    assert [(e.host, e.chips, e.env) for e in ray.engines] == [(0, (), {"JAX_PLATFORMS": "cpu"})]


def test_cpu_layout_sets_simulated_devices_and_keeps_other_xla_flags():
    plan = plan_layout(cfg(2, 2, 2), CPU8, xla_flags="--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
    assert plan.backend == "uni"
    for s in plan.stages:
        assert s.env == {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2",
        }
    assert plan.engine(1).env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=4")
    assert [s.chips for s in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("hw", [CPU8, V5E, V5E_2, V4, V4_2, V3, V7X, Hardware("cpu", num_hosts=3, chips_per_host=6)])
def test_every_layout_that_fits_has_disjoint_chips_and_ports_per_host(hw):
    for pp, tp, dp in itertools.product(range(1, 9), (1, 2, 3, 4, 8, 16), range(1, 5)):
        try:
            plan = plan_layout(cfg(pp, tp, dp), hw)
        except LayoutError:
            continue
        assert plan.hosts_used <= hw.num_hosts
        assert (plan.backend == "uni") == (pp * len(plan.stages[0].chips) <= hw.chips_per_host)
        for host in range(plan.hosts_used):
            chips = [c for s in plan.stages if s.host == host for c in s.chips]
            assert len(chips) == len(set(chips)) and max(chips) < hw.chips_per_host, (pp, tp, dp, host)
            if hw.platform == "tpu":
                ports = [s.env["TPU_PROCESS_PORT"] for s in plan.stages if s.host == host]
                assert len(ports) == len(set(ports))


def test_check_layout_returns_a_new_config():
    config = cfg(2, 2)
    checked = check_layout(config, CPU8)
    assert checked.distributed_executor_backend == "uni"
    assert config.distributed_executor_backend is None  # frozen input untouched
    assert dataclasses.replace(checked, distributed_executor_backend=None) == config


@pytest.mark.parametrize(
    "hw, config, fragments",
    [
        pytest.param(V5E, cfg(1, 16), ["tensor_parallel_size=16 does not fit one host", "8 chips",
                                       "tensor_parallel_size in 1, 2, 4, 8"], id="tp-over-host"),
        pytest.param(V5E, cfg(1, 3), ["needs 3 chips per stage", "1, 2, 4 or 8 chips",
                                      "tensor_parallel_size in 1, 2, 4, 8"], id="tp-not-a-box"),
        pytest.param(V3, cfg(1, 3), ["does not fill whole chips", "2 devices (TensorCores)",
                                     "tensor_parallel_size in 1, 2, 4, 8"], id="tp-half-chip"),
        pytest.param(V5E_2, cfg(4, 4, 2), ["needs 4 hosts", "2 TPU v5e hosts x 8 chips",
                                           "data_parallel_size <= 1 with pipeline_parallel_size=4",
                                           "pipeline_parallel_size <= 2 with data_parallel_size=2"], id="too-many"),
        pytest.param(V5E_2, cfg(3, 4, backend="uni"), ["'uni' runs every stage in one process on one host",
                                                       "needs 12 chips", "distributed_executor_backend='ray'"],
                     id="uni-spanning-hosts"),
        pytest.param(CPU8, cfg(3, 4), ["needs 2 hosts", "1 CPU (simulated devices) host x 8 simulated devices",
                                       "pipeline_parallel_size <= 2 with data_parallel_size=1"], id="cpu-too-many"),
        pytest.param(CPU8, cfg(1, 9), ["a host has 8 simulated devices", "tensor_parallel_size in 1..8"],
                     id="cpu-tp-over-host"),
    ],
)
def test_layout_errors_say_what_fits(hw, config, fragments):
    with pytest.raises(LayoutError) as err:
        check_layout(config, hw)
    assert isinstance(err.value, ValueError)
    for fragment in fragments:
        assert fragment in str(err.value)
