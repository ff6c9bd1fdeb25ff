"""The engine's frozen config: the model, plus one config per concern (layout, cache/batching)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pipejax.pp_utils import ParallelConfig
from pipejax.runner.config import CacheConfig, StageConfig

if TYPE_CHECKING:
    from pipejax.worker import WorkerConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str  # a folder holding a Hugging Face checkpoint (resolved from None by the caller)
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    dtype: str | None = None
    seed: int = 0
    model_impl: str = "jax"
    max_batches_in_flight: int | None = None  # None: one per pipeline stage (1 turns pipelining off)
    step_timeout_s: float = 300.0  # a batch that has not come back by then is an error, never a hang
    # Keep the timings of the last N steps (the engine's batches in flight, each stage's step start/end;
    # ``executor.step_trace()``) for tests and profiling. 0: trace nothing (serving).
    step_trace_len: int = 0
    # Ray executor: cluster address (None: RAY_ADDRESS, else a local cluster), a placement group the
    # caller already created (e.g. Ray Serve), and how long to wait for one to be placed.
    ray_address: str | None = None
    placement_group: Any = None
    placement_timeout_s: float = 120.0
    ray_compiled_graph: bool = False  # chain the stage actors in a Ray Compiled Graph (control messages only)
    # Ray executor on the CPU backend: confine each stage actor to its own equal share of its node's
    # cores, so stages on one host do not share cores (as stages on their own chips would not).
    pin_stage_cpus: bool = False

    def worker_config(self, pp_rank: int) -> WorkerConfig:
        """What the stage worker of ``pp_rank`` gets (the same for every executor)."""
        from pipejax.worker import WorkerConfig

        par = self.parallel
        return WorkerConfig(
            model=self.model,
            stage=StageConfig(pp_rank, par.pipeline_parallel_size, par.pp_layer_partition),
            tp_size=par.tensor_parallel_size,
            cache=self.cache,
            dtype=self.dtype,
            seed=self.seed,
            model_impl=self.model_impl,
            step_trace_len=self.step_trace_len,
        )
