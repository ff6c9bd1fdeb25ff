"""Starting, watching and stopping the DP engine cores: Ray actors (backend ``ray``) or local processes (``mp``).

Backend ``ray``: every rank gets a placement group of pp bundles in Ray's units (``{TPU: chips}`` on
TPU clusters, the CPU device resource in development; see ``ray_placement.stage_units``), PACKed,
created from the head; ``data_parallel_size_local`` of them are pinned to the head's node
(label ``ray.io/node-id``) and the others kept off it, or, without it, Ray places all of them by
resources. The engine-core actor (no resources of its own) sits in bundle 0 and its
``RayExecutor`` creates the stage actors in the same group, so a rank's stages land where its
bundles were reserved; Ray grants each stage its own TPU chip ids, so engines sharing a host hold
disjoint chips. Addresses go to the actors as arguments; nothing is asked back.

Backend ``mp``: each local engine process starts with the environment the platform plans for it
(``PlatformPlan.engines``: its own box of chips on a TPU host).

On CPU the engines on one host share its KV cache budget (``CacheConfig.cpu_kvcache_space``): each engine
gets the count of engines on its most crowded host in ``CacheConfig.engines_on_host`` (``ray``: from where
the placement groups were placed; ``mp``: the engines this command starts here).

``poll_dead`` reports each engine that ended, with the cause (not naming the engine), exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.serving.addresses import LOOPBACK, DPAddresses
from pipejax.ray_executor.serving.engine_core import EngineCoreActor, run_engine_process

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
MAX_REBUILDS = 3  # times the head rebuilds one data-parallel engine that ended (RayEngines.rebuild)


def engines_sharing_hosts(nodes_per_engine: list[set[str]]) -> list[int]:
    """For each engine (the nodes its stages were placed on), the most engines that share one of its nodes."""
    count: dict[str, int] = {}
    for nodes in nodes_per_engine:
        for node in nodes:
            count[node] = count.get(node, 0) + 1
    return [max((count[n] for n in nodes), default=1) for nodes in nodes_per_engine]


def with_engines_on_host(config: EngineConfig, engines_on_host: int) -> EngineConfig:
    """``config`` for an engine that shares its host with ``engines_on_host - 1`` others (its KV budget share)."""
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, engines_on_host=engines_on_host))


def _cause(exc: BaseException) -> str:
    """The first line of an error (Ray's actor errors go on for a screen)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")


_env_lock = threading.Lock()


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` updated with ``env`` inside the block (one block at a time), restored after."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class RayEngines:
    def __init__(self, config: EngineConfig, dp_size: int, dp_local: int | None, addresses: DPAddresses,
                 warmup: bool = True):
        self.config = config
        self.dp_size = dp_size
        self.dp_local = dp_local
        self.addresses = addresses
        self.warmup = warmup
        self.actors: list = []
        self.groups: list = []
        self.nodes: list[str] = []  # each rank's bundle-0 node
        self.engines_on_host: list[int] = []  # each rank's count of engines on its most crowded host
        self._pending: dict = {}  # run() ref -> rank
        self._started_ray = False
        self.units = None  # ray_placement.StageUnits, once placed
        self.rebuilds = [0] * dp_size  # engines rebuilt per rank (``rebuild``)

    def place(self) -> None:
        """Connect to Ray and reserve every rank's placement group (``groups``, ``nodes``, ``units``)."""
        import ray

        from pipejax.ray_executor.executor.ray_placement import connect, refuse_unplaceable, stage_units
        from pipejax.ray_executor.platforms import current_platform

        par, settings = self.config.parallel, self.config.ray
        platform = current_platform(self.config.platform_plugin)
        self._started_ray = connect(settings.address, platform, self.dp_size * par.world_size, settings.device_resource)
        pp, tp = par.pipeline_parallel_size, par.tensor_parallel_size
        self.units = stage_units(platform, pp, tp, settings.device_resource)
        refuse_unplaceable(self.units, self.dp_size * pp, "-dp/-pp/-tp")
        head = ray.get_runtime_context().get_node_id()
        self.groups = [self._placement_group(rank, head, self.units) for rank in range(self.dp_size)]
        self._wait_placed(self.units)
        self._check_reachable(head)

    def start(self) -> None:
        self.place()
        for rank in range(self.dp_size):
            self.actors.append(self._engine_actor(rank))
            self._pending[self.actors[rank].run.remote()] = rank
        par = self.config.parallel
        log.info("started %d engine-core actors (pp=%d x tp=%d each) on nodes %s", self.dp_size,
                 par.pipeline_parallel_size, par.tensor_parallel_size, [n[:8] for n in self.nodes])

    def _engine_actor(self, rank: int):
        """Rank ``rank``'s engine-core actor, in bundle 0 of its placement group (its stages take the others)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pipejax.ray_executor.executor.ray_placement import base_environment

        pg = self.groups[rank]
        actor_class = ray.remote(concurrency_groups={"control": 1})(EngineCoreActor)
        return actor_class.options(
            num_cpus=0,
            name=f"pipejax-engine-{rank}-{pg.id.hex()[:8]}-{time.time_ns()}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            runtime_env={"env_vars": base_environment()},
        ).remote(with_engines_on_host(self.config, self.engines_on_host[rank]), rank, self.addresses, self.warmup,
                 placement_group=pg, incarnation=self.rebuilds[rank])

    def rebuild(self, rank: int) -> bool:
        """After rank ``rank``'s engine ended: a new engine-core actor for it in the same placement group (Ray
        moves the bundles of a dead node to a live one with the resources, else they wait for one), which
        announces itself to the API servers when it is up. False once the rank was rebuilt ``MAX_REBUILDS`` times
        (an engine that keeps dying is left dead)."""
        import ray

        if self.rebuilds[rank] >= MAX_REBUILDS:
            return False
        self.rebuilds[rank] += 1
        ray.kill(self.actors[rank], no_restart=True)  # its stage actors go with it (it owns them)
        self.actors[rank] = self._engine_actor(rank)
        self._pending[self.actors[rank].run.remote()] = rank
        log.warning("data-parallel engine %d: rebuilding it (%d of %d)", rank, self.rebuilds[rank], MAX_REBUILDS)
        return True

    def _placement_group(self, rank: int, head: str, units):
        from ray.util.placement_group import placement_group

        bundles = units.bundles(self.config.parallel.pipeline_parallel_size)
        selector = None
        if self.dp_local is not None:
            node = head if rank < self.dp_local else f"!{head}"
            selector = [{"ray.io/node-id": node} for _ in bundles]
        return placement_group(bundles, strategy="PACK", name=f"pipejax-dp{rank}-{time.time_ns()}",
                               bundle_label_selector=selector)

    def _wait_placed(self, units) -> None:
        import ray
        from ray.util.placement_group import placement_group_table

        timeout = self.config.ray.placement_timeout_s
        ready, waiting = ray.wait([pg.ready() for pg in self.groups], num_returns=len(self.groups), timeout=timeout)
        if waiting:
            par, resource = self.config.parallel, units.resource
            nodes = ", ".join(f"{n['NodeID'][:8]}: {n['Resources'].get(resource, 0):g}"
                              for n in ray.nodes() if n.get("Alive"))
            where = (f"{self.dp_local} of them on the head node, the rest on other nodes"
                     if self.dp_local is not None else "anywhere")
            raise ValueError(
                f"the Ray cluster could not place {self.dp_size} data-parallel engines of {par.pipeline_parallel_size} "
                f"x {units.bundles(1)[0]} ({where}) within {timeout:.0f}s; only "
                f"{len(ready)} fit. '{resource}' per node: {nodes}. Add nodes, or lower -dp/-pp/-tp/-dpl."
            )
        placed = [placement_group_table(pg)["bundles_to_node_id"] for pg in self.groups]
        self.nodes = [bundles[0] for bundles in placed]
        self.engines_on_host = engines_sharing_hosts([set(bundles.values()) for bundles in placed])

    def _check_reachable(self, head: str) -> None:
        """Engines on another machine cannot reach sockets bound to loopback."""
        import ray

        if self.addresses.host != LOOPBACK:
            return
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        far = sorted({ips[n] for n in self.nodes} - {ips[head]})
        if far:
            raise ValueError(
                f"data-parallel engines were placed on hosts {far}, which cannot reach the API server's sockets "
                f"on {LOOPBACK}; pass --data-parallel-address {ips[head]} (an address of this host they can reach)"
            )

    def poll_dead(self, timeout_s: float) -> dict[int, str]:
        import ray

        if not self._pending:
            time.sleep(timeout_s)
            return {}
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout_s)
        dead = {}
        for ref in done:
            rank = self._pending.pop(ref)
            try:
                dead[rank] = f"its actor ended: {ray.get(ref, timeout=10)}"
            except Exception as exc:
                dead[rank] = _cause(exc)
        return dead

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                actor.stop.options(concurrency_group="control").remote()
            except Exception:
                pass
        if self._pending:
            done, late = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=STOP_TIMEOUT_S)
            log.info("engines stopped: %d cleanly, %d killed", len(done), len(late))
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for pg in self.groups:
            try:
                ray.util.remove_placement_group(pg)
            except Exception as exc:
                log.warning("placement group not removed: %s", exc)
        self.actors, self.groups, self._pending = [], [], {}
        if self._started_ray:
            ray.shutdown()


class ProcessEngines:
    """Backend ``mp``: ranks ``ranks`` as local processes (spawned: each imports JAX with its own devices).

    They are stopped with SIGTERM (an engine finishes its loop and exits), then killed after
    ``STOP_TIMEOUT_S``; no shared lock is involved, so an engine that was killed cannot wedge the stop.
    """

    def __init__(self, config: EngineConfig, ranks: range, addresses: DPAddresses, warmup: bool = True):
        self.config = config
        self.ranks = ranks
        self.addresses = addresses
        self.warmup = warmup
        self.procs: dict[int, multiprocessing.Process] = {}

    def environment(self, rank: int) -> dict[str, str]:
        """What engine ``rank`` starts with: the platform's plan for the engines this host starts
        (on TPU its own box of chips, disjoint from the others'; under 'ray' JAX's CPU backend)."""
        from pipejax.ray_executor.platforms import current_platform

        platform = current_platform(self.config.platform_plugin)
        return platform.engine_environment(self.config.parallel, self.ranks.index(rank), len(self.ranks))

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in self.ranks:
            config = with_engines_on_host(self.config, len(self.ranks))  # every one of them is on this host
            proc = ctx.Process(target=run_engine_process, name=f"pipejax-engine-{rank}",
                               args=(config, rank, self.addresses, self.warmup))
            # A spawned process takes this process's environment when it starts (and JAX reads it at
            # import, before the target runs): set the engine's for the start, then put ours back.
            with _environment(self.environment(rank)):
                proc.start()
            self.procs[rank] = proc
        log.info("started engine processes %s", {r: p.pid for r, p in self.procs.items()})

    def rebuild(self, rank: int) -> bool:
        """Local engine processes are not rebuilt here (a supervisor restarts the server): always False."""
        return False

    def poll_dead(self, timeout_s: float) -> dict[int, str]:
        alive = [p.sentinel for p in self.procs.values() if p.exitcode is None]
        if alive:
            multiprocessing.connection.wait(alive, timeout=timeout_s)
        else:
            time.sleep(timeout_s)
        dead = {}
        for rank, proc in list(self.procs.items()):
            if proc.exitcode is not None:
                dead[rank] = f"its process (pid {proc.pid}) exited with code {proc.exitcode}"
                del self.procs[rank]
        return dead

    @property
    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs.values())

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.exitcode is None:
                log.warning("engine process %d did not stop in %.0fs: killing it", proc.pid, STOP_TIMEOUT_S)
                proc.kill()
                proc.join(timeout=5)
        self.procs = {}
