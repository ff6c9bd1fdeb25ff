"""Ray cluster, placement group, stage actors and their per-host environment for the Ray executor.

Units are Ray's own: on a cluster with TPU nodes a stage asks for ``TPU`` chips (and an engine that
spans a multi-host slice holds the slice's ``TPU-<pod type>-head``), so pipejax shares the cluster
with other Ray work; on CPU development clusters a declared resource counts simulated devices.

The platform decides each stage's environment on the stage's own node: the actor detects its host
there (before JAX is imported in it), and a TPU stage takes the very chips Ray granted it (its
``TPU`` resource ids), so every stage of every engine on a host holds different chips.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pipejax.pp_utils import WorkerRecord, rank_workers
from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE
from pipejax.ray_executor.executor.stage_actor import StageActor

log = logging.getLogger(__name__)

TPU_RESOURCE = "TPU"  # Ray's own: one per chip
PASSED_ENV_PREFIXES = ("PIPEJAX_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "RAY_CGRAPH_")
# Ray would set TPU_VISIBLE_CHIPS and the bounds from the granted ids before every task; the stage
# sets its own, from the same ids, once.
NOSET_TPU_ENV = {"RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS": "1"}


@dataclasses.dataclass(frozen=True)
class StageUnits:
    """What one stage asks Ray for: ``per_stage`` of ``resource``; bundle 0 also holds ``slice_head``."""

    resource: str
    per_stage: int
    slice_head: str | None = None

    def bundles(self, pp: int) -> list[dict[str, float]]:
        out = [{self.resource: float(self.per_stage)} for _ in range(pp)]
        if self.slice_head:
            out[0][self.slice_head] = 1.0
        return out


def connect(address: str | None, platform, devices_needed: int, device_resource: str = CPU_DEVICE_RESOURCE) -> bool:
    """Join ``address`` (``RayConfig.address``) or start a local cluster, which on CPU declares
    ``devices_needed`` of ``device_resource``; True when this call started Ray."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    # The embedded default: a local cluster of this one node. On a TPU host Ray counts its chips itself;
    # on CPU the node declares the simulated devices. address="local" always starts a new cluster: a bare
    # init would attach to any cluster already running on this machine and then refuse the resources.
    resources = {} if platform.is_tpu() else {device_resource: devices_needed}
    ray.init(address="local", resources=resources, include_dashboard=False, log_to_driver=False)
    return True


def stage_units(platform, pp: int, tp: int, device_resource: str = CPU_DEVICE_RESOURCE) -> StageUnits:
    """Ray's units for a stage of ``tp`` devices on this cluster: ``TPU`` chips where the cluster has TPU
    nodes (unless CPU was asked for), else ``device_resource`` (``RayConfig.device_resource``, one per
    simulated device). Reads the live nodes' resources."""
    asked = platform.requested_mode
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    tpu_nodes = {n["NodeManagerAddress"]: platform.ray_node_hardware(n["Resources"]) for n in nodes
                 if n["Resources"].get(TPU_RESOURCE, 0) > 0}
    if asked == "cpu" or not tpu_nodes:
        if asked == "tpu":
            raise ValueError(f"PIPEJAX_PLATFORM=tpu, but no node of the Ray cluster lists a '{TPU_RESOURCE}' "
                             f"resource ({len(nodes)} nodes alive); start Ray on the TPU hosts, or unset it")
        return StageUnits(device_resource, tp)
    unknown = sorted(ip for ip, hw in tpu_nodes.items() if hw is None)
    if unknown:
        raise ValueError(
            f"Ray nodes {unknown} list '{TPU_RESOURCE}' chips but no 'accelerator_type:TPU-<generation>' resource, "
            f"so a stage's chips cannot be counted (v2, v3 and v7x chips hold 2 devices). Start Ray there with "
            f"TPU_ACCELERATOR_TYPE set (e.g. v5litepod-8), as TPU VMs and GKE set it"
        )
    per_chip = {hw.cores_per_chip for hw in tpu_nodes.values()}
    if len(per_chip) > 1:
        raise ValueError(f"the Ray cluster mixes TPU generations ({_kinds(tpu_nodes)}); a pipejax engine needs "
                         f"one: run it on a cluster (or label selection) of one generation")
    host = max(tpu_nodes.values(), key=lambda hw: hw.chips_per_host)
    chips = platform.stage_chips(tp, host)
    heads = sorted({h for n in nodes for h in platform.ray_slice_heads(n["Resources"])})
    spans_hosts = pp * chips > host.chips_per_host
    return StageUnits(TPU_RESOURCE, chips, heads[0] if heads and spans_hosts else None)


def _kinds(tpu_nodes: dict) -> str:
    return ", ".join(f"{ip}: {hw.generation}" for ip, hw in sorted(tpu_nodes.items()))


def refuse_unplaceable(units: StageUnits, stages: int, what: str = "pp/tp") -> None:
    """ValueError at once when the live nodes could never hold ``stages`` bundles of ``units`` in CPU mode,
    where the resource is a label that nodes declare when Ray starts on them: waiting out the placement
    timeout would not help. TPU chips are left to the timeout (an autoscaler may still add TPU nodes)."""
    if units.resource == TPU_RESOURCE:
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = sum(int(n["Resources"].get(units.resource, 0) // units.per_stage) for n in nodes)
    if fits >= stages:
        return
    per_node = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): {n['Resources'].get(units.resource, 0):g}"
                         for n in nodes) or "no live nodes"
    raise ValueError(
        f"the Ray cluster cannot place {stages} stages of {units.per_stage} '{units.resource}' each (a stage never "
        f"spans nodes): its nodes hold {fits}. '{units.resource}' per node: {per_node}. Declare them where Ray "
        f"starts (ray start --head --resources '{{\"{units.resource}\": {stages * units.per_stage}}}', or on more "
        f"nodes), let pipejax start a cluster of its own (no RAY_ADDRESS / ray_address, no ray.init of yours), "
        f"or lower {what}."
    )


def create_placement_group(pp: int, units: StageUnits, timeout_s: float) -> PlacementGroup:
    """PP bundles of ``units``, PACKed, the first pinned to the driver's node if it has the devices (and
    no slice head is asked for: that pins bundle 0 to the slice's worker 0)."""
    refuse_unplaceable(units, pp)
    bundles = units.bundles(pp)
    driver_node = ray.get_runtime_context().get_node_id()
    here = next((n for n in ray.nodes() if n["NodeID"] == driver_node), None)
    if not units.slice_head and here is not None and here["Resources"].get(units.resource, 0) >= units.per_stage:
        bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
    name = f"pipejax-pp{pp}-{units.resource}{units.per_stage}-{os.getpid()}-{time.time_ns()}"
    pg = placement_group(bundles, strategy="PACK", name=name)
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=min(10.0, max(0.1, deadline - time.monotonic())))
        if ready:
            return pg
        if time.monotonic() >= deadline:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(_missing_resources_message(bundles, units.resource, timeout_s))
        log.info("waiting for a placement group of %s ...", bundles)


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


def driver_variables() -> dict[str, str]:
    """The driver's pipejax / Hugging Face variables, which every stage and engine-core process gets
    (as a local child process would): this forwards the environment, it reads no setting."""
    return {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)}


def base_environment() -> dict[str, str]:
    """What a stage (or engine-core) actor starts with, before it knows its chips: no device claimed
    (JAX, if anything imported it this early, would take the CPU), and Ray told not to set chips."""
    return driver_variables() | NOSET_TPU_ENV | {"JAX_PLATFORMS": "cpu"}


@dataclasses.dataclass
class StageGroup:
    """The stage actors of one engine, ranked, each with its environment set (JAX not yet imported)."""

    actors: list[Any]
    placement: list[dict[str, Any]]  # per rank: node_id, ip, host, pid, local_rank, local_world_size,
    #                                   hardware (its host's), chips, env


def launch_stages(platform, pg: PlacementGroup, pp: int, tp: int, units: StageUnits, timeout_s: float,
                  cpus_for=None, platform_plugin: str | None = None) -> StageGroup:
    """Start ``pp`` stage actors in ``pg``'s bundles, rank them by where they landed, and set each one's
    environment from its own host: the host detected on that node (or, failing that, as that Ray node
    lists it), the chips Ray granted it. ``cpus_for(actors, placement)`` may give each its cores;
    ``platform_plugin`` (``EngineConfig.platform_plugin``) picks each actor's platform as the driver's."""
    actors = [_stage_actor(pg, i, units) for i in range(pp)]
    try:
        reports = ray.get([a.host_report.remote(platform_plugin) for a in actors], timeout=timeout_s)
        # Re-rank by where the actors landed: creation order is never trusted.
        records = [WorkerRecord(r["node_id"], r["ip"], n) for n, r in enumerate(reports)]
        ranked = rank_workers(records, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())
        actors = [actors[r.record.creation_index] for r in ranked]
        placement = [{**reports[r.record.creation_index], "bundle": r.record.creation_index,
                      "local_rank": r.local_rank, "local_world_size": r.local_world_size} for r in ranked]
        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
        for rank, p in enumerate(placement):  # the platform decides per host
            _plan_on_host(platform, p, resources.get(p["node_id"], {}), units, tp, rank)
        cpus = cpus_for(actors, placement) if cpus_for else [None] * pp
        ray.get([a.set_environment.remote(p["env"], c) for a, p, c in zip(actors, placement, cpus, strict=True)],
                timeout=timeout_s)
    except BaseException:  # a stage that cannot be set up must not keep its bundle's chips
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return StageGroup(actors, placement)


def _stage_actor(pg: PlacementGroup, bundle: int, units: StageUnits):
    """A stage actor (JAX not loaded yet) in ``pg``'s bundle ``bundle``; Ray starts it once the bundle is placed."""
    # ping answers while a step runs; a later step's activations are pulled while the current one runs
    actor_class = ray.remote(concurrency_groups={"health": 1, "prefetch": 1})(StageActor)
    return actor_class.options(
        num_cpus=0,
        resources={units.resource: units.per_stage},
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        runtime_env={"env_vars": base_environment()},
    ).remote()


def end_stage_processes(placements: list[dict]) -> None:
    """SIGKILL the processes of lost stages whose nodes are still up, through a task on each node, without
    waiting for it: a frozen process (stopped, or stuck where Ray's own kill request is never read) keeps its
    bundle and, in a compiled graph, holds the teardown until it dies; one on a node that cannot be reached is
    left to Ray, which moves its bundle once it declares the node dead."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    for p in placements:
        if p["node_id"] in alive:
            strategy = NodeAffinitySchedulingStrategy(p["node_id"], soft=False)
            _kill_stage_process.options(scheduling_strategy=strategy).remote(p["pid"])


@ray.remote(num_cpus=0, max_retries=0)
def _kill_stage_process(pid: int) -> bool:
    import signal

    try:  # only a stage actor's process: the pid may have been reused since
        if b"StageActor" not in open(f"/proc/{pid}/cmdline", "rb").read():
            return False
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def replace_stage(platform, pg: PlacementGroup, rank: int, lost: dict, others: list[dict], tp: int,
                  units: StageUnits, timeout_s: float, platform_plugin: str | None = None) -> tuple[Any, dict]:
    """A new actor for the stage of ``rank`` whose actor (placement ``lost``) is gone: in the same bundle of
    ``pg``, which Ray keeps on the same node while it lives and re-places on another node with the resources
    when it died (waiting up to ``timeout_s`` for one). Its environment comes from its own host, as at launch;
    on a node shared with the live stages (``others``' placements) it takes the first box of devices they leave.
    Returns the actor (JAX not loaded yet) and its placement."""
    actor = _stage_actor(pg, lost["bundle"], units)
    try:
        report = ray.get(actor.host_report.remote(platform_plugin), timeout=timeout_s)
        taken = {p["local_rank"] for p in others if p["node_id"] == report["node_id"]}
        local_rank = min(set(range(len(taken) + 1)) - taken)
        p = {**report, "bundle": lost["bundle"], "local_rank": local_rank, "local_world_size": len(taken) + 1}
        resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == p["node_id"]), {})
        _plan_on_host(platform, p, resources, units, tp, rank)
        ray.get(actor.set_environment.remote(p["env"], None), timeout=timeout_s)
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    return actor, p


def _plan_on_host(platform, p: dict, node_resources: dict, units: StageUnits, tp: int, rank: int) -> None:
    """Fill placement ``p`` of stage ``rank`` with what its own host decides: its hardware, its chips (or box of
    simulated devices) and the environment the stage starts JAX with."""
    p["hardware"] = _stage_host(platform, p, node_resources, units, rank)
    p["chips"] = _stage_chips(platform, p, tp, units)
    p["env"] = {**driver_variables(), **NOSET_TPU_ENV, **platform.stage_environment(p["hardware"], p["chips"], tp)}


def _stage_host(platform, p: dict, node_resources: dict, units: StageUnits, rank: int):
    """The host of a stage: as detected on its node; a node Ray granted TPU chips but where detection saw
    none (no PCI ids, device files or TPU_ACCELERATOR_TYPE there) is taken as its Ray resources list it."""
    hw = p["detected"]
    if units.resource == TPU_RESOURCE and hw.platform != "tpu":
        hw = platform.ray_node_hardware(node_resources)
        if hw is None:
            raise ValueError(f"stage {rank} on {p['ip']} holds '{TPU_RESOURCE}' chips, but neither the host "
                             f"({p['detected'].describe()}) nor its Ray resources show a TPU generation; set "
                             f"TPU_ACCELERATOR_TYPE on that node")
    return hw


def _stage_chips(platform, p: dict, tp: int, units: StageUnits) -> tuple[int, ...]:
    """The chips Ray granted (TPU ids); without them (CPU devices) the ``local_rank``-th box of the host."""
    if p["granted_tpu_ids"] and p["hardware"].platform == "tpu":
        return tuple(sorted(int(i) for i in p["granted_tpu_ids"]))
    per = platform.stage_chips(tp, p["hardware"])
    return tuple(range(p["local_rank"] * per, (p["local_rank"] + 1) * per))
