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
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import jax

from pipejax.pp_utils import InProcessTransport, stage_devices
from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.executor.base import Executor, choose_kv_cache
from pipejax.runner.batch import ModelBatch, SamplerOutput
from pipejax.worker import StageWorker

log = logging.getLogger(__name__)

_STOP = object()


class _Call:
    """A ``collective_rpc`` call queued to one stage's thread."""

    def __init__(self, method: str, args: tuple, kwargs: dict):
        self.method, self.args, self.kwargs = method, args, kwargs
        self.future: Future[Any] = Future()

    def run(self, worker: StageWorker) -> None:
        try:
            self.future.set_result(getattr(worker, self.method)(*self.args, **self.kwargs))
        except Exception as exc:
            self.future.set_exception(exc)


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        par = config.parallel
        groups = stage_devices(jax.devices(), par.pipeline_parallel_size, par.tensor_parallel_size)
        links = [InProcessTransport(f"stage {i}") for i in range(par.pipeline_parallel_size - 1)]
        self.workers = []
        for rank, devices in enumerate(groups):
            recv = links[rank - 1] if rank > 0 else None
            send = links[rank] if rank < len(links) else None
            self.workers.append(StageWorker(config.worker_config(rank), devices, recv, send))
        # Every stage is in this process, on this host: they share its RAM on CPU.
        self.kv_cache = choose_kv_cache([w.kv_cache_plan(stages_on_host=len(self.workers)) for w in self.workers])
        self.num_kv_blocks = self.kv_cache.num_blocks
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

    def execute_model(self, batch: ModelBatch) -> Future[SamplerOutput]:
        future: Future[SamplerOutput] = Future()
        for q in self._queues:
            q.put((batch, future))
        return future

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        calls = [_Call(method, args, kwargs) for _ in self._queues]
        for q, call in zip(self._queues, calls, strict=True):  # each stage runs it on its own thread, in turn
            q.put(call)
        wait_s = timeout or self.config.step_timeout_s
        deadline = time.monotonic() + wait_s
        results = []
        for rank, call in enumerate(calls):
            try:
                results.append(call.future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                raise TimeoutError(f"stage {rank} did not finish {method}() within {wait_s}s") from None
        return results

    def _stage_loop(self, worker: StageWorker, inbox: queue.Queue) -> None:
        while (item := inbox.get()) is not _STOP:
            if isinstance(item, _Call):
                item.run(worker)
                continue
            batch, future = item
            try:
                out = worker.execute_model(batch)
                if worker.stage.is_last and not future.done():
                    future.set_result(out)
            except Exception as exc:  # the engine sees it through the future
                log.exception("stage %d failed on step %d", worker.stage.pp_rank, batch.step_id)
                if not future.done():
                    future.set_exception(exc)

    def shutdown(self) -> None:
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            t.join(timeout=5)
        for w in self.workers:
            w.close()
