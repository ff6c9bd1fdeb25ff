"""The executor interface: run a batch through all stages, get a future of the last stage's output."""

from __future__ import annotations

import abc
from concurrent.futures import Future

from pipejax.ray_executor.config import EngineConfig
from pipejax.runner.batch import ModelBatch, SamplerOutput
from pipejax.worker import StageInfo


class Executor(abc.ABC):
    config: EngineConfig
    num_kv_blocks: int
    block_size: int

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine may keep in flight: one per pipeline stage (unless the config caps it)."""
        return self.config.max_batches_in_flight or self.config.parallel.pipeline_parallel_size

    @abc.abstractmethod
    def execute_model(self, batch: ModelBatch) -> Future[SamplerOutput]:
        """Start ``batch`` on every stage; the future resolves to the last stage's sampled tokens."""

    def warmup(self, progress: bool = True) -> None:
        """Compile the common padding buckets before serving."""

    @abc.abstractmethod
    def stage_infos(self) -> list[StageInfo]:
        """Where each stage runs, by pp rank."""

    def step_trace(self) -> list[tuple[int, int, float, float]]:
        """(pp_rank, step_id, start, end) of executed steps, for tests and profiling."""
        return []

    def check_health(self) -> None:
        """Raise an error naming the stage and host if a stage is gone; called while a step is pending."""

    def shutdown(self) -> None:
        """Stop workers; idempotent."""


def executor_class(backend: str | None) -> type[Executor]:
    """Map a backend name to its executor class, importing Ray only when Ray is chosen."""
    if backend in (None, "uni"):
        from pipejax.ray_executor.executor.inprocess import InProcessExecutor

        return InProcessExecutor
    if backend == "ray":
        from pipejax.ray_executor.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend={backend!r}; use 'uni' or 'ray'")
