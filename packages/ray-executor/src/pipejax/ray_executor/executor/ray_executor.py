"""PP Ray workers, each controlling the TP devices of one stage, on as many hosts as the cluster has.

The driver sends only control messages (the batch) to every stage actor; activations go from
stage to stage through each stage's JAX transfer server. Actor calls queue per actor, so
with several batches submitted, stage 0 runs batch k+1 while stage 1 runs batch k.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import ray

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.executor.base import Executor, NoStageLost, StagesLost, choose_kv_cache
from pipejax.ray_executor.executor.compiled_graph import CompiledPipeline
from pipejax.ray_executor.executor.ray_placement import (
    TPU_RESOURCE,
    connect,
    create_placement_group,
    end_stage_processes,
    launch_stages,
    replace_stage,
    stage_units,
)
from pipejax.ray_executor.platforms import current_platform
from pipejax.runner.batch import ModelBatch, SamplerOutput

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # a stage that does not answer a ping (its health thread) within this is lost
REPLACE_RETRY_S = 1.0  # between tries to start a lost stage's replacement while its host is not yet marked dead
# One try to start a replacement. Once in CI (compiled graph, a stage SIGKILLed on a live host, the driver told the
# actor was "temporarily unavailable" rather than dead) the replacement did not start in 120 s; the cause was not
# found in 7 local repeats, and a fresh actor in the same bundle is cheap to try.
REPLACE_TRY_S = 30.0


class StageFailedError(StagesLost):
    """A stage's actor died or raised; names the stage and its host (``lost``: the ranks, where a health check
    found them)."""


class RecoveryFailedError(RuntimeError):
    """Lost stages could not be replaced (no node with the resources within the recovery timeout, or the
    replacement failed to start); names the stages and what was tried."""


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, placement_group: Any = None):
        """``placement_group``: pp bundles the caller already created (kept at shutdown); None: create one."""
        self.config = config
        self._silent: set[int] = set()  # ranks whose last ping went unanswered (``lost_stages``): maybe frozen
        par, settings = config.parallel, config.ray
        pp, tp = par.pipeline_parallel_size, par.tensor_parallel_size
        platform = current_platform(config.platform_plugin)
        self.platform = platform
        self._started_ray = connect(settings.address, platform, pp * tp, settings.device_resource)
        self.units = stage_units(platform, pp, tp, settings.device_resource)
        self._own_pg = placement_group is None
        self.pg = placement_group or create_placement_group(pp, self.units, settings.placement_timeout_s)
        timeout = config.step_timeout_s
        stages = launch_stages(platform, self.pg, pp, tp, self.units, timeout,
                               cpus_for=self._stage_cpus if settings.pin_stage_cpus else None,
                               platform_plugin=config.platform_plugin)
        self.actors, self.placement = stages.actors, stages.placement
        self.addresses: list[str] = ray.get(
            [
                a.init_worker.remote(config.worker_config(rank), self.placement[rank]["ip"], self._name(rank))
                for rank, a in enumerate(self.actors)
            ],
            timeout=timeout,
        )
        ray.get(
            [self.actors[r].connect_previous.remote(self.addresses[r - 1], self._name(r - 1)) for r in range(1, pp)],
            timeout=timeout,
        )
        self.pipeline: CompiledPipeline | None = None  # compiled lazily, after warm-up (plain calls)
        self._unfinished: set[Future] = set()  # plain mode: steps submitted whose result has not come back
        # On CPU, stages on one host share its RAM: each sizes its KV cache for the most crowded host.
        crowded = max(p["local_world_size"] for p in self.placement)
        self.kv_cache = choose_kv_cache(self.collective_rpc("kv_cache_plan", stages_on_host=crowded))
        self.num_kv_blocks = self.kv_cache.num_blocks
        self.block_size = config.cache.block_size
        self.collective_rpc("load", self.num_kv_blocks)
        log.info("ray executor: %s", "; ".join(self._name(r) for r in range(pp)))

    def _stage_cpus(self, actors: list, placement: list[dict]) -> list[list[int]]:
        """Each stage's share of its node's cores: the cores its actor may use, split evenly and
        disjointly among the stages on that node by local rank."""
        if self.units.resource == TPU_RESOURCE:
            raise ValueError("pin_stage_cpus is for the CPU backend (simulated devices); drop it on TPU hosts")
        allowed = ray.get([a.allowed_cpus.remote() for a in actors], timeout=self.config.step_timeout_s)
        out = []
        for rank, cores in enumerate(allowed):
            p = placement[rank]
            share, n = len(cores) // p["local_world_size"], p["local_world_size"]
            if share == 0:
                raise ValueError(
                    f"pin_stage_cpus: stage {rank} on {p['ip']} shares {len(cores)} core(s) with {n - 1} other "
                    f"stage(s); each stage needs at least one: drop pin_stage_cpus or use fewer stages per host"
                )
            out.append(cores[p["local_rank"] * share : (p["local_rank"] + 1) * share])
        return out

    def _name(self, rank: int) -> str:
        p = self.placement[rank]
        return f"stage {rank} (host {p['host']}, ip {p['ip']}, node {p['node_id'][:8]}, pid {p['pid']})"

    # --- Executor ----------------------------------------------------------------------------

    def execute_model(self, batch: ModelBatch) -> Future[SamplerOutput]:
        if self.config.ray.compiled_graph:
            if self.pipeline is None:
                self.pipeline = CompiledPipeline(self.actors, 2 * len(self.actors), self.config.step_timeout_s,
                                                 describe_error=self._compiled_step_error,
                                                 channel=self.config.ray.graph_channel)
            return self.pipeline.submit(batch)
        refs = [a.call.remote("execute_model", batch) for a in self.actors]
        if self._unfinished:  # each stage reaches this step only after those: its pull can start meanwhile
            for actor in self.actors[1:]:
                actor.prefetch.remote(batch)
        result: Future[SamplerOutput] = Future()
        self._unfinished.add(result)
        result.add_done_callback(self._unfinished.discard)
        for rank, ref in enumerate(refs):
            ref.future().add_done_callback(lambda f, rank=rank: self._stage_done(rank, f, result))
        return result

    def _compiled_step_error(self, exc: Exception) -> StageFailedError:
        """A compiled-graph step's Ray error, naming the stage (and host) whose actor it was, as plain mode does."""
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        dead = str(getattr(exc, "actor_id", "") or "")
        for rank, actor in enumerate(self.actors):
            if dead and dead == actor._actor_id.hex():
                return StageFailedError(f"{self._name(rank)} is gone (compiled graph): {type(exc).__name__}: {cause}")
        return StageFailedError(f"compiled graph step failed: {type(exc).__name__}: {exc}")

    def _stage_done(self, rank: int, stage_future: Future, result: Future) -> None:
        if result.done():
            return
        exc = stage_future.exception()
        if exc is not None:
            error = StageFailedError(f"{self._name(rank)} failed on a step: {type(exc).__name__}: {exc}")
            try:
                result.set_exception(error)
            except Exception:  # another stage won the race
                pass
        elif rank == len(self.actors) - 1:
            try:
                result.set_result(stage_future.result())
            except Exception:
                pass

    def check_health(self) -> None:
        lost = self.lost_stages()
        if lost:
            raise StageFailedError(f"{self._names(lost)} gone or did not answer a health check within "
                                   f"{HEALTH_TIMEOUT_S:.0f}s; its host may be lost or cut off", lost)

    def hung_stages(self, step_id: int) -> list[int]:
        try:
            done = ray.get([a.progress.remote() for a in self.actors], timeout=HEALTH_TIMEOUT_S)
        except ray.exceptions.RayError:
            return []  # a stage that does not answer is a lost one: the health check's to find
        hung = [next(r for r, d in enumerate(done) if d < step_id)] if min(done) < step_id else []
        self._silent.update(hung)  # alive but stuck: its process is ended before it is replaced
        return hung

    def _names(self, ranks: list[int]) -> str:
        return "; ".join(self._name(r) for r in ranks)

    # --- recovery ----------------------------------------------------------------------------

    can_recover = True

    def lost_stages(self) -> list[int]:
        """The ranks whose stage is gone: its node is dead in Ray's view, its actor died, or its health thread
        did not answer a ping within ``HEALTH_TIMEOUT_S`` (a host cut off, a frozen process)."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        pings = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=HEALTH_TIMEOUT_S)
        lost = []
        self._silent = {rank for rank, ping in enumerate(pings) if ping not in ready}
        for rank, ping in enumerate(pings):
            if self.placement[rank]["node_id"] not in alive or ping not in ready:
                lost.append(rank)
                continue
            try:
                ray.get(ping, timeout=0)
            except ray.exceptions.RayError:
                lost.append(rank)
        return lost

    def recover(self, timeout_s: float, lost: list[int] | None = None) -> dict[str, float]:
        """Replace every lost stage (``lost``, as a health check found them, else ``lost_stages``) and reconnect
        the pipeline; the live stages keep their
        process, weights and compiled programs. Every step in flight is lost: the engine re-runs its requests.
        Returns seconds per phase ("find": which stages are lost, "drain": the lost processes ended (a frozen one by
        SIGKILL on its node) and the live stages' queued steps,
        "place": the replacements started where Ray put their bundles, "load": their weights and KV cache,
        "connect": the transport relinked); raises ``RecoveryFailedError`` where a
        stage cannot be replaced within ``timeout_s``, and ``NoStageLost`` where no stage is lost (a step
        that failed on live stages is not a host's loss)."""
        deadline = time.monotonic() + timeout_s
        phases: dict[str, float] = {}
        mark = time.monotonic()
        self._end_silent(lost or [])  # a frozen stage must be ending before a compiled graph's teardown waits on it
        if self.pipeline is not None:  # its channels include the dead actor's; rebuilt at the next step
            self.pipeline.teardown(kill_actors=False)
            self.pipeline = None
        self._unfinished.clear()  # the engine drops every step in flight
        lost = lost or self.lost_stages()
        phases["find"], mark = time.monotonic() - mark, time.monotonic()
        if not lost:
            raise NoStageLost("a step failed but every stage answers: no stage is lost, so none is replaced")
        names = [self._name(r) for r in lost]
        log.warning("recovering: replacing %s", self._names(lost))
        self._end_silent(lost)
        for rank in lost:
            ray.kill(self.actors[rank], no_restart=True)
        live = [r for r in range(len(self.actors)) if r not in lost]
        # A live stage after a lost one may be waiting for activations that will never come: end those waits,
        # then let every live stage run out the steps still queued on it.
        ray.get([self.actors[r].abort_receives.remote() for r in live if r - 1 in lost], timeout=HEALTH_TIMEOUT_S)
        try:
            ray.get([self.actors[r].drained.remote() for r in live], timeout=self._left(deadline))
        except ray.exceptions.GetTimeoutError:
            raise RecoveryFailedError(f"live stages did not finish their queued steps within {timeout_s:.0f}s "
                                      f"while replacing {'; '.join(names)}") from None
        phases["drain"], mark = time.monotonic() - mark, time.monotonic()
        for rank in lost:
            others = [p for r, p in enumerate(self.placement) if r not in lost or r < rank]
            self.actors[rank], self.placement[rank] = self._replace(rank, others, names[lost.index(rank)], deadline,
                                                                     timeout_s)
        phases["place"], mark = time.monotonic() - mark, time.monotonic()
        addresses = ray.get([self.actors[r].init_worker.remote(self.config.worker_config(r), self.placement[r]["ip"],
                                                               self._name(r)) for r in lost],
                            timeout=self._left(deadline))
        for rank, address in zip(lost, addresses, strict=True):
            self.addresses[rank] = address
        ray.get([self.actors[r].call.remote("load", self.num_kv_blocks) for r in lost], timeout=self._left(deadline))
        phases["load"], mark = time.monotonic() - mark, time.monotonic()
        relinked = sorted({r for r in lost if r > 0} | {r + 1 for r in lost if r + 1 < len(self.actors)})
        ray.get([self.actors[r].connect_previous.remote(self.addresses[r - 1], self._name(r - 1)) for r in relinked],
                timeout=self._left(deadline))
        phases["connect"] = time.monotonic() - mark
        log.warning("recovered: %s", self._names(lost))
        return phases

    def _end_silent(self, lost: list[int]) -> None:
        """SIGKILL (``end_stage_processes``, not waited for) the lost stages that did not answer a ping or hung:
        their processes may live on where Ray's own kill request is never read."""
        silent = [r for r in lost if r in self._silent]
        self._silent -= set(silent)
        if silent:
            end_stage_processes([self.placement[r] for r in silent])

    def _replace(self, rank: int, others: list[dict], name: str, deadline: float, timeout_s: float):
        """A new actor and placement for the lost stage ``rank``. Until Ray marks a lost host dead, its bundle
        stays there and a replacement started in it dies with the host: such tries are repeated (every
        ``REPLACE_RETRY_S``) until the bundle moves to a live node or ``deadline`` passes; a replacement that has
        not started within ``REPLACE_TRY_S`` is ended and another one tried."""
        while True:
            try:
                return replace_stage(self.platform, self.pg, rank, self.placement[rank], others,
                                     self.config.parallel.tensor_parallel_size, self.units,
                                     min(REPLACE_TRY_S, self._left(deadline)), self.config.platform_plugin)
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() + REPLACE_RETRY_S >= deadline:
                    break
                log.warning("a replacement for %s did not start within %.0fs; trying another", name, REPLACE_TRY_S)
            except ray.exceptions.RayActorError as exc:
                log.info("a replacement for %s did not start (%s); trying again", name, type(exc).__name__)
                if time.monotonic() + REPLACE_RETRY_S >= deadline:
                    break
                time.sleep(REPLACE_RETRY_S)
        raise RecoveryFailedError(
            f"no node could take {name} within {timeout_s:.0f}s: the placement group's bundle "
            f"{self.placement[rank]['bundle']} ({self.units.per_stage} '{self.units.resource}') was not placed "
            f"again; add a node with those resources or bring the host back"
        )

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.1, deadline - time.monotonic())

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        # Plain mode queues the call behind the submitted steps; in compiled-graph mode the graph runs on
        # the actors' background thread and the call on their main thread (only reads while steps run).
        refs = [a.call.remote(method, *args, **kwargs) for a in self.actors]
        return ray.get(refs, timeout=timeout or self.config.step_timeout_s)

    def shutdown(self) -> None:
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.teardown()
            self.pipeline = None
        for a in getattr(self, "actors", []):
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._own_pg and getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
