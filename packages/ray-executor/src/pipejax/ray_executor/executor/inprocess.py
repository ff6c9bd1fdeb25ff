"""All pp x tp stages in this process, on disjoint device subsets (single host).

Every stage has its own thread: the driver hands each submitted batch to every stage; stage i
receives stage i-1's activations through an in-process transport (a ``jax.device_put`` into
its own sharding), runs, and passes its output on. JAX releases the GIL while it computes, so
stage 0 can work on batch k+1 while stage 1 finishes batch k.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

import jax

from pipejax.pp_utils import InProcessTransport, stage_devices
from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.executor.base import Executor
from pipejax.runner.batch import ModelBatch, SamplerOutput
from pipejax.runner.config import StageConfig
from pipejax.worker import StageInfo, StageWorker, WorkerConfig

log = logging.getLogger(__name__)

_STOP = object()


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        par = config.parallel
        groups = stage_devices(jax.devices(), par.pipeline_parallel_size, par.tensor_parallel_size)
        links = [InProcessTransport(f"stage {i}") for i in range(par.pipeline_parallel_size - 1)]
        self.workers = []
        for rank, devices in enumerate(groups):
            wc = WorkerConfig(
                model=config.model,
                stage=StageConfig(rank, par.pipeline_parallel_size, par.pp_layer_partition),
                tp_size=par.tensor_parallel_size,
                cache=config.cache,
                dtype=config.dtype,
                seed=config.seed,
                model_impl=config.model_impl,
            )
            recv = links[rank - 1] if rank > 0 else None
            send = links[rank] if rank < len(links) else None
            self.workers.append(StageWorker(wc, devices, recv, send))
        # Every stage holds the same block ids, so all use the smallest count any can afford.
        self.num_kv_blocks = min(w.available_kv_blocks() for w in self.workers)
        self.block_size = config.cache.block_size
        for w in self.workers:
            w.load(self.num_kv_blocks)
        self._queues: list[queue.Queue] = [queue.Queue() for _ in self.workers]
        self._threads = [
            threading.Thread(target=self._stage_loop, args=(w, q), name=f"pipejax-stage-{w.stage.pp_rank}", daemon=True)
            for w, q in zip(self.workers, self._queues, strict=True)
        ]
        for t in self._threads:
            t.start()

    def warmup(self, progress: bool = True) -> None:
        batches = self.workers[0].warmup_batches()
        futures = [self.execute_model(b) for b in batches]
        for f in futures:
            f.result(timeout=self.config.step_timeout_s)

    def execute_model(self, batch: ModelBatch) -> Future[SamplerOutput]:
        future: Future[SamplerOutput] = Future()
        for q in self._queues:
            q.put((batch, future))
        return future

    def _stage_loop(self, worker: StageWorker, inbox: queue.Queue) -> None:
        while (item := inbox.get()) is not _STOP:
            batch, future = item
            try:
                out = worker.execute_model(batch)
                if worker.stage.is_last and not future.done():
                    future.set_result(out)
            except Exception as exc:  # the engine sees it through the future
                log.exception("stage %d failed on step %d", worker.stage.pp_rank, batch.step_id)
                if not future.done():
                    future.set_exception(exc)

    def stage_infos(self) -> list[StageInfo]:
        return [w.info() for w in self.workers]

    def step_trace(self) -> list[tuple[int, int, float, float]]:
        return sorted((t for w in self.workers for t in w.trace), key=lambda t: t[2])

    def shutdown(self) -> None:
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            t.join(timeout=5)
