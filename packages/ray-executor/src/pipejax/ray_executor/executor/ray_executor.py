"""PP Ray workers, each controlling the TP devices of one stage, on as many hosts as the cluster has.

The driver sends only control messages (the batch) to every stage actor; activations go from
stage to stage through each stage's JAX transfer server. Actor calls queue per actor, so
with several batches submitted, stage 0 runs batch k+1 while stage 1 runs batch k.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import ray

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.executor.base import Executor, choose_kv_cache
from pipejax.ray_executor.executor.compiled_graph import CompiledPipeline
from pipejax.ray_executor.executor.ray_placement import (
    TPU_RESOURCE,
    connect,
    create_placement_group,
    launch_stages,
    stage_units,
)
from pipejax.ray_executor.platforms import current_platform
from pipejax.runner.batch import ModelBatch, SamplerOutput

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


class StageFailedError(RuntimeError):
    """A stage's actor died or raised; names the stage and its host."""


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, placement_group: Any = None):
        """``placement_group``: pp bundles the caller already created (kept at shutdown); None: create one."""
        self.config = config
        par, settings = config.parallel, config.ray
        pp, tp = par.pipeline_parallel_size, par.tensor_parallel_size
        platform = current_platform(config.platform_plugin)
        self._started_ray = connect(settings.address, platform, pp * tp, settings.device_resource)
        self.units = stage_units(platform, pp, tp, settings.device_resource)
        self._own_pg = placement_group is None
        self.pg = placement_group or create_placement_group(pp, self.units, settings.placement_timeout_s)
        timeout = config.step_timeout_s
        stages = launch_stages(platform, self.pg, pp, tp, self.units, timeout,
                               cpus_for=self._stage_cpus if settings.pin_stage_cpus else None,
                               platform_plugin=config.platform_plugin)
        self.actors, self.placement = stages.actors, stages.placement
        addresses = ray.get(
            [
                a.init_worker.remote(config.worker_config(rank), self.placement[rank]["ip"], self._name(rank))
                for rank, a in enumerate(self.actors)
            ],
            timeout=timeout,
        )
        ray.get(
            [self.actors[r].connect_previous.remote(addresses[r - 1], self._name(r - 1)) for r in range(1, pp)],
            timeout=timeout,
        )
        self.pipeline: CompiledPipeline | None = None  # compiled lazily, after warm-up (plain calls)
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
                                                 describe_error=self._compiled_step_error)
            return self.pipeline.submit(batch)
        refs = [a.call.remote("execute_model", batch) for a in self.actors]
        result: Future[SamplerOutput] = Future()
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
        if self.pipeline is not None:  # actors inside a compiled graph serve no other calls: ask the GCS
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            for rank, p in enumerate(self.placement):
                if p["node_id"] not in alive:
                    raise StageFailedError(f"{self._name(rank)} is gone: its node is no longer alive")
            return
        pings = [a.ping.remote() for a in self.actors]
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=HEALTH_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise StageFailedError(
                    f"{self._name(rank)} did not answer a health check within {HEALTH_TIMEOUT_S:.0f}s; "
                    f"its host may be lost or cut off"
                ) from None
            except ray.exceptions.RayError as exc:
                raise StageFailedError(f"{self._name(rank)} is gone: {type(exc).__name__}: {exc}") from None

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
