"""The accelerator path on a Ray cluster of faked TPU hosts: what each stage actor's environment is.

A cluster of simulated Ray nodes (``ray.cluster_utils.Cluster``) where a "v5e-8 host" is a node whose
raylet, and so every worker it starts, has the TPU VM's ``TPU_ACCELERATOR_TYPE=v5litepod-8`` (what the
platform's cheap detection reads on that node) and lists Ray's own ``TPU: 8`` and
``accelerator_type:TPU-V5LITEPOD`` resources (what Ray itself lists on a TPU VM). A CPU-only node has
neither. The test process is the driver, on the head node.

The stage actors are started by the executor's own code (``launch_stages``: placement, detection on
the stage's node, ranking, the platform's per-host environment set in the actor), and stop there,
where the executor's next call (``init_worker``) would import JAX onto chips this machine does not
have. Each actor's environment is read back from the actor itself, with proof that JAX is not loaded
in it (JAX reads ``JAX_PLATFORMS`` once, at import: a value set after that would not count).

``-dpb mp``: the engine processes are started for real (``ProcessEngines.start``) on a faked TPU host
(this process, with ``TPU_ACCELERATOR_TYPE``) and their environment is read from ``/proc/<pid>/environ``:
what the process was started with, before it could import anything.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from pipejax.pp_utils import ParallelConfig
from pipejax.ray_executor.config import EngineConfig, ModelSource
from pipejax.ray_executor.executor.ray_placement import create_placement_group, launch_stages, stage_units
from pipejax.ray_executor.platforms import current_platform, reset_current_platform
from pipejax.ray_executor.serving.addresses import DPAddresses
from pipejax.ray_executor.serving.engines import ProcessEngines, RayEngines

pytestmark = pytest.mark.timeout(300)

V5E_8_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}
V5E_8_RESOURCES = {"TPU": 8, "accelerator_type:TPU-V5LITEPOD": 1}
TIMEOUT_S = 60


def v5e_host(**kw) -> dict:
    return {"num_cpus": 1, "resources": V5E_8_RESOURCES, "env_vars": V5E_8_ENV, **kw}


@pytest.fixture
def cluster(request):
    """A cluster of the nodes ``request.param`` lists (the first is the head); the driver joins it."""
    nodes = request.param
    c = Cluster(initialize_head=True, head_node_args=nodes[0])
    for node in nodes[1:]:
        c.add_node(**node)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes(timeout=TIMEOUT_S)
    yield c
    ray.shutdown()
    c.shutdown()


def read_back(group) -> list[dict]:
    """Each stage actor's environment, from the actor; JAX must not be loaded there yet."""
    got = ray.get([a.environment.remote() for a in group.actors], timeout=TIMEOUT_S)
    for rank, g in enumerate(got):
        assert not g["jax_loaded"], f"stage {rank} imported JAX before its chips were set"
    return [g["env"] for g in got]


def tpu_view(env: dict) -> dict:
    keys = ("JAX_PLATFORMS", "TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS",
            "TPU_PROCESS_PORT", "ALLOW_MULTIPLE_LIBTPU_LOAD")
    return {k: env.get(k) for k in keys}


def box(chips: str, port: int) -> dict:
    return {"JAX_PLATFORMS": "tpu,cpu", "TPU_VISIBLE_CHIPS": chips, "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
            "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": str(port), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def stages(pp: int, tp: int):
    platform = current_platform()  # this process: a CPU host (the driver detects nothing for the stages)
    assert platform.is_simulated()
    units = stage_units(platform, pp, tp)
    pg = create_placement_group(pp, units, TIMEOUT_S)
    return units, pg, launch_stages(platform, pg, pp, tp, units, TIMEOUT_S)


@pytest.mark.parametrize("cluster", [[v5e_host()]], indirect=True)
def test_pp2_tp4_on_one_v5e_8_host(cluster):
    units, pg, group = stages(pp=2, tp=4)
    assert (units.resource, units.per_stage, units.slice_head) == ("TPU", 4, None)  # Ray's unit: chips
    envs = read_back(group)
    assert [tpu_view(e) for e in envs] == [box("0,1,2,3", 8476), box("4,5,6,7", 8480)]
    assert [p["hardware"].describe() for p in group.placement] == ["1 TPU v5e host x 8 chips x 1 core = 8 devices"] * 2
    assert all(e["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"] == "1" for e in envs)  # Ray keeps out of our chips


@pytest.mark.parametrize("cluster", [[{"num_cpus": 1}, v5e_host(), v5e_host()]], indirect=True)
def test_pp4_tp4_over_two_v5e_8_hosts_with_a_cpu_only_head(cluster):
    units, pg, group = stages(pp=4, tp=4)
    envs = read_back(group)
    head = ray.get_runtime_context().get_node_id()
    nodes = [p["node_id"] for p in group.placement]
    assert head not in nodes and len(set(nodes)) == 2
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3]  # ranks contiguous per host
    assert [p["local_rank"] for p in group.placement] == [0, 1, 0, 1]
    assert [tpu_view(e) for e in envs] == [box("0,1,2,3", 8476), box("4,5,6,7", 8480)] * 2
    assert all("TPU_ACCELERATOR_TYPE" in e for e in envs)  # each detected on its own (TPU) node


@pytest.mark.parametrize("cluster", [[v5e_host()]], indirect=True)
def test_dp2_pp1_tp4_on_one_v5e_8_host_with_ray_engines(cluster):
    parallel = ParallelConfig(1, 4, 2, distributed_executor_backend="ray")
    addresses = DPAddresses.create(None, None, 1)
    engines = RayEngines(EngineConfig(ModelSource("unused"), parallel), dp_size=2, dp_local=2, addresses=addresses)
    try:
        engines.place()  # what `pipejax serve -dp 2 -dpl 2 -dpb ray` reserves
        platform = current_platform()
        # each engine core's RayExecutor launches its stages in its own group (its placement_group argument)
        groups = [launch_stages(platform, pg, 1, 4, engines.units, TIMEOUT_S) for pg in engines.groups]
        envs = [read_back(g)[0] for g in groups]
    finally:
        engines.shutdown()
    chips = sorted(e["TPU_VISIBLE_CHIPS"] for e in envs)
    assert chips == ["0,1,2,3", "4,5,6,7"], envs  # disjoint: Ray granted each engine's stage its own chips
    assert sorted(int(e["TPU_PROCESS_PORT"]) for e in envs) == [8476, 8480]


def test_dp2_pp1_tp4_on_one_v5e_8_host_with_engine_processes(monkeypatch):
    """-dpb mp: each engine process starts with its own box (``PlatformPlan.engines``), not ours."""
    for key, value in V5E_8_ENV.items():
        monkeypatch.setenv(key, value)
    reset_current_platform()
    config = EngineConfig(ModelSource("unused"), ParallelConfig(1, 4, 2, distributed_executor_backend="uni"))
    engines = ProcessEngines(config, range(2), DPAddresses.create(None, None, 1), warmup=False)
    try:
        assert current_platform().is_tpu()
        before = dict(os.environ)
        engines.start()
        started = {rank: read_proc_environ(proc.pid) for rank, proc in engines.procs.items()}
        assert dict(os.environ) == before  # the launcher's own environment is put back
    finally:
        engines.shutdown()
        reset_current_platform()
    assert [tpu_view(started[r]) for r in (0, 1)] == [box("0,1,2,3", 8476), box("4,5,6,7", 8480)]


def read_proc_environ(pid: int) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while True:  # the exec may not have happened yet
        raw = open(f"/proc/{pid}/environ", "rb").read()
        env = dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
        if env or time.monotonic() > deadline:
            return env
        time.sleep(0.01)


V4_16_HEAD = {"num_cpus": 1, "resources": {"TPU": 4, "accelerator_type:TPU-V4": 1, "TPU-v4-16-head": 1},
              "env_vars": {"TPU_ACCELERATOR_TYPE": "v4-16"}}
V4_16_WORKER_NO_ENV = {"num_cpus": 1, "resources": {"TPU": 4, "accelerator_type:TPU-V4": 1}}  # nothing to detect


@pytest.mark.parametrize("cluster", [[{"num_cpus": 1}, V4_16_HEAD, V4_16_WORKER_NO_ENV]], indirect=True)
def test_engine_over_a_multi_host_slice_holds_its_head_and_hosts_fall_back_to_ray_resources(cluster):
    """pp2 x tp4 over the two 4-chip hosts of a v4-16 slice: bundle 0 holds the slice's TPU-v4-16-head
    (Ray's slice reservation unit), so it lands on the slice's worker 0; the other host shows no TPU to
    the platform's probes, so its stage's host is taken from that node's Ray resources."""
    units, pg, group = stages(pp=2, tp=4)
    assert (units.resource, units.per_stage, units.slice_head) == ("TPU", 4, "TPU-v4-16-head")
    envs = read_back(group)
    resources = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
    on_head = [r for r, p in enumerate(group.placement) if "TPU-v4-16-head" in resources[p["node_id"]]]
    assert len(on_head) == 1 and len({p["node_id"] for p in group.placement}) == 2
    other = 1 - on_head[0]
    assert group.placement[other]["detected"].platform == "cpu"  # what the probes saw there
    assert [p["hardware"].describe() for p in group.placement] == ["1 TPU v4 host x 4 chips x 1 core = 4 devices"] * 2
    for env in envs:  # each a whole 4-chip host: no other process shares its libtpu
        assert tpu_view(env) == {**box("0,1,2,3", 8476), "ALLOW_MULTIPLE_LIBTPU_LOAD": None}
        assert env["TPU_WORKER_HOSTNAMES"] == "localhost"  # never joins the slice's other hosts
    assert ray.util.placement_group_table(pg)["bundles"][0].get("TPU-v4-16-head") == 1.0
