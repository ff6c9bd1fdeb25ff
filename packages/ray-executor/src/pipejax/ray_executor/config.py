"""The engine's frozen config, one section per concern: which model, the layout, the KV cache, the
batching limits, and how the Ray executor runs. It holds no live handle: a placement group the caller
already created goes to the engine (and its executor) as an argument.

Nothing below reads environment variables: ``engine_args.engine_config`` (behind the CLI and ``LLM``)
fills the fields they stand for (``RAY_ADDRESS``, ``PIPEJAX_RAY_DEVICE_RESOURCE``, ``PIPEJAX_PLATFORM_PLUGIN``,
``PIPEJAX_COMPILATION_CACHE_DIR``, ``PIPEJAX_PP_LAYER_PARTITION``); a config built directly gets the
defaults below."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipejax.pp_utils import ParallelConfig
from pipejax.runner.config import CacheConfig, ModelSource, SchedulerConfig, StageConfig

if TYPE_CHECKING:
    from pipejax.worker import WorkerConfig


CPU_DEVICE_RESOURCE = "pipejax_cpu_device"  # what CPU development clusters declare per simulated device


def _default_compilation_cache_dir() -> str | None:
    from pipejax.worker.worker import compilation_cache_dir  # the worker owns the rule; imported late

    return compilation_cache_dir(None)


GRAPH_CHANNELS = ("zmq", "shared_memory")  # a compiled graph's edges (executor/graph_channel.py says why zmq)


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """The Ray executor's settings (the other executors ignore them)."""

    address: str | None = None  # the cluster's address; None: a local cluster (engine_config: RAY_ADDRESS)
    # The Ray resource that counts a stage's simulated devices on a CPU cluster (TPU clusters use Ray's 'TPU').
    device_resource: str = CPU_DEVICE_RESOURCE
    placement_timeout_s: float = 120.0  # how long to wait for the placement group to be placed
    compiled_graph: bool = False  # chain the stage actors in a Ray Compiled Graph (control messages only)
    # The compiled graph's edges: "zmq" (a reader sleeps until its message comes; executor/graph_channel.py) or
    # "shared_memory" (Ray's own channel, whose idle readers spin on a core each).
    graph_channel: str = "zmq"
    # On the CPU backend: confine each stage actor to its own equal share of its node's cores, so stages
    # on one host do not share cores (as stages on their own chips would not).
    pin_stage_cpus: bool = False

    def __post_init__(self):
        if self.graph_channel not in GRAPH_CHANNELS:
            raise ValueError(f"graph_channel={self.graph_channel!r}; use one of {', '.join(GRAPH_CHANNELS)}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelSource
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    ray: RayConfig = RayConfig()
    # The engine loop's own settings:
    max_batches_in_flight: int | None = None  # None: one per pipeline stage (1 turns pipelining off)
    step_timeout_s: float = 300.0  # a batch that has not come back by then is an error, never a hang
    # A lost stage (its actor, its host) is replaced and the requests in flight are prefilled again, where the
    # executor can (Ray); only when no replacement is up within recovery_timeout_s do they fail.
    recovery: bool = True
    recovery_timeout_s: float = 120.0
    # Keep the timings of the last N steps (the engine's batches in flight, each stage's step start/end;
    # ``executor.step_trace()``) for tests and profiling. 0: trace nothing (serving).
    step_trace_len: int = 0
    # Process-wide settings, the same for every stage:
    platform_plugin: str | None = None  # the pipejax.platform_plugins entry point to use when several apply
    # JAX's persistent compilation cache of every stage process (None: none).
    compilation_cache_dir: str | None = dataclasses.field(default_factory=_default_compilation_cache_dir)
    # How a stage waits for a CPU kernel numba has not built on its host (runner.cpu.select.KERNEL_BUILDS).
    cpu_kernel_build: str = "background"
    # The dense kernel's tiles on CPU (runner.cpu.select.DENSE_TILES; "amx" keeps no AMX tiles beside the weights).
    cpu_dense_tiles: str = "auto"
    # Benchmarks of the schedule only: every stage's step takes at least this long, asleep for what its real work
    # leaves (``WorkerConfig.simulated_step_s``), so a pipeline's bubbles show on a host with fewer cores than stages.
    simulated_step_s: float = 0.0

    def worker_config(self, pp_rank: int) -> WorkerConfig:
        """What the stage worker of ``pp_rank`` gets (the same for every executor)."""
        from pipejax.worker import WorkerConfig

        par = self.parallel
        return WorkerConfig(
            model=self.model,
            stage=StageConfig(pp_rank, par.pipeline_parallel_size, par.pp_layer_partition, par.enable_expert_parallel),
            tp_size=par.tensor_parallel_size,
            cache=self.cache,
            scheduler=self.scheduler,
            compilation_cache_dir=self.compilation_cache_dir,
            step_trace_len=self.step_trace_len,
            cpu_kernel_build=self.cpu_kernel_build,
            cpu_dense_tiles=self.cpu_dense_tiles,
            simulated_step_s=self.simulated_step_s,
        )
