"""Ray cluster, placement group and per-stage environment for the Ray executor."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group

log = logging.getLogger(__name__)

CPU_DEVICE_RESOURCE = "pipejax_cpu_device"  # what CPU development clusters declare per simulated device
PASSED_ENV_PREFIXES = ("PIPEJAX_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "RAY_CGRAPH_")


def device_resource(platform) -> str:
    """The Ray resource one stage device takes: the platform's (``TPU``), or a declared one on CPU."""
    return platform.ray_device_key or os.environ.get("PIPEJAX_RAY_DEVICE_RESOURCE", CPU_DEVICE_RESOURCE)


def connect(address: str | None, resource: str, devices_needed: int) -> bool:
    """Join ``address``/``RAY_ADDRESS`` or start a local cluster; True when this call started Ray."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    # The embedded default: a local cluster whose one node holds the simulated devices.
    # address="local" always starts a new cluster: a bare init would attach to any cluster already
    # running on this machine and then refuse the resources argument.
    ray.init(address="local", resources={resource: devices_needed}, include_dashboard=False, log_to_driver=False)
    return True


def create_placement_group(pp: int, tp: int, resource: str, timeout_s: float) -> PlacementGroup:
    """PP bundles of ``{resource: tp}``, PACKed, the first pinned to the driver's node if it has devices."""
    bundles = [{resource: float(tp)} for _ in range(pp)]
    driver_ip = ray.util.get_node_ip_address()
    driver_node = ray.get_runtime_context().get_node_id()
    here = next((n for n in ray.nodes() if n["NodeID"] == driver_node), None)
    if here is not None and here["Resources"].get(resource, 0) >= tp:
        bundles[0][f"node:{driver_ip}"] = 0.001
    pg = placement_group(bundles, strategy="PACK", name=f"pipejax-pp{pp}-tp{tp}-{os.getpid()}-{time.time_ns()}")
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=min(10.0, max(0.1, deadline - time.monotonic())))
        if ready:
            return pg
        if time.monotonic() >= deadline:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(_missing_resources_message(bundles, resource, timeout_s))
        log.info("waiting for a placement group of %d x {%s: %d} ...", pp, resource, tp)


def _missing_resources_message(bundles: list[dict], resource: str, timeout_s: float) -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = ", ".join(
        f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): {n['Resources'].get(resource, 0):g} {resource}" for n in nodes
    ) or "no live nodes"
    want = ", ".join(str({k: v for k, v in b.items() if not k.startswith("node:")}) for b in bundles)
    return (
        f"the Ray cluster could not place {len(bundles)} stage bundles [{want}] within {timeout_s:.0f}s "
        f"(strategy PACK; a stage never spans nodes, so each needs one node with that many '{resource}'). "
        f"Nodes have: {per_node}. Add nodes or declare the resource (ray start --resources "
        f"'{{\"{resource}\": N}}'), or lower pp/tp; `ray status` shows what is free."
    )


def stage_environments(platform, parallel, placement: list[dict]) -> list[dict[str, str]]:
    """Per rank: the platform's environment for the stage (visible chips, process bounds, task id; on
    CPU the simulated device count) plus the driver's pipejax/HF variables.

    The platform plans stages host by host; rank r, the ``local_rank``-th stage on its node, takes
    the environment the plan gives the ``local_rank``-th stage of a host.
    """
    hosts = len({p["node_id"] for p in placement})
    plan = type(platform)(mode=platform.mode, num_hosts=hosts).plan(
        dataclasses.replace(parallel, data_parallel_size=1, distributed_executor_backend="ray")
    )
    by_host: dict[int, list] = {}
    for stage in plan.stages:
        by_host.setdefault(stage.host, []).append(stage)
    passed = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)}
    return [{**passed, **by_host[0][p["local_rank"]].env} for p in placement]


def base_environment() -> dict[str, str]:
    """What a stage actor starts with, before it knows its rank: no device is claimed yet."""
    return {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)} | {"JAX_PLATFORMS": "cpu"}
