"""The executor interface: run a batch through all stages, get a future of the last stage's output;
call any method of every stage's worker (``collective_rpc``). ``factory.py`` maps backend names to classes."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from tqdm import tqdm

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.executor.startup import StartupReport
from pipejax.runner.batch import ModelBatch, SamplerOutput
from pipejax.worker import StageInfo
from pipejax.worker.kv_sizing import KVCachePlan

log = logging.getLogger(__name__)


def choose_kv_cache(plans: Sequence[KVCachePlan]) -> KVCachePlan:
    """Every stage holds the same block ids, so all take the smallest count any stage can afford; that
    stage's plan is the engine's, logged in one line (``pipejax generate`` prints it)."""
    plan = min(plans, key=lambda p: p.num_blocks)
    log.info("%s", plan.describe())
    return plan


class StagesLost(RuntimeError):
    """Stages are gone; ``lost``: their ranks where the detector knows them (``Executor.recover`` then replaces
    exactly those instead of finding them again)."""

    def __init__(self, message: str, lost: list[int] | None = None):
        super().__init__(message)
        self.lost = lost


class NoStageLost(RuntimeError):
    """``Executor.recover`` found every stage answering: the step failed for another reason, and replacing
    stages (now or later) would not help."""


class Executor(abc.ABC):
    config: EngineConfig
    kv_cache: KVCachePlan  # the KV cache every stage holds (``choose_kv_cache``)
    num_kv_blocks: int
    block_size: int

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine may keep in flight: one per pipeline stage (unless the config caps it)."""
        return self.config.max_batches_in_flight or self.config.parallel.pipeline_parallel_size

    @abc.abstractmethod
    def execute_model(self, batch: ModelBatch) -> Future[SamplerOutput]:
        """Start ``batch`` on every stage; the future resolves to the last stage's sampled tokens."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` of every stage's ``StageWorker``, on all stages at once, after the
        steps already submitted; the results by pp rank. ``timeout`` (default: the config's step timeout)
        bounds the wait; a stage's exception is raised here (the lowest rank's first)."""

    def warmup(self, progress: bool = True, batches: list[ModelBatch] | None = None) -> None:
        """Compile the common padding buckets now (``warmup_batches``), or the shapes of ``batches`` where given,
        one shape at a time on every stage; the progress bar shows only when that takes more than a few seconds."""
        batches = self.warmup_batches() if batches is None else batches
        for batch in tqdm(batches, desc="compiling step shapes", unit="shape", delay=3, leave=False,
                          disable=not progress):
            self.warmup_one(batch)

    def warmup_batches(self) -> list[ModelBatch]:
        """Dummy batches, one per common padding bucket (stage 0's ``StageWorker.warmup_batches``)."""
        return self.collective_rpc("warmup_batches")[0]

    def warmup_one(self, batch: ModelBatch) -> None:
        """Compile ``batch``'s shape on every stage by running it (between steps: nothing may be in flight)."""
        self.collective_rpc("warmup", [batch], progress=False)

    def startup_report(self) -> StartupReport:
        """Where the stages' set-up went (processes, weights, warm-up) and the XLA programs each has built."""
        where = [(info.host, info.pid) for info in self.stage_infos()]
        return StartupReport.from_stages(self.collective_rpc("setup_timings"), self.collective_rpc("compile_stats"),
                                         where)

    def stage_infos(self) -> list[StageInfo]:
        """Where each stage runs, by pp rank."""
        return self.collective_rpc("info")

    def step_trace(self) -> list[tuple[int, int, float, float]]:
        """(pp_rank, step_id, start, end) of the steps every stage traced (when tracing is on), by start time."""
        return sorted((t for trace in self.collective_rpc("step_trace") for t in trace), key=lambda t: t[2])

    def activation_bytes_sent(self) -> list[int]:
        """Activation bytes each stage has sent to the next one, by pp rank (the last sends none)."""
        return self.collective_rpc("activation_bytes_sent")

    can_recover = False  # whether ``recover`` can replace lost stages (the Ray executor's can)

    def lost_stages(self) -> list[int]:
        """The ranks of stages that are gone (none where stages live in the engine's process)."""
        return []

    def hung_stages(self, step_id: int) -> list[int]:
        """Step ``step_id`` is past its deadline while every stage answers: the stage it waits on (the first that
        has not finished it), to be replaced as a lost one; [] where that cannot be told."""
        return []

    def recover(self, timeout_s: float, lost: list[int] | None = None) -> dict[str, float]:
        """Replace the stages that are gone (``lost``, else found now) within ``timeout_s``; seconds per phase.
        Executors whose stages live in the engine's own process cannot (their loss is the engine's)."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace lost stages")

    def check_health(self) -> None:
        """Raise an error naming the stage and host if a stage is gone; called while a step is pending."""

    def shutdown(self) -> None:
        """Stop workers; idempotent."""

