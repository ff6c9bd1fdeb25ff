"""pipejax.worker: one process's share of a pipeline (a stage's TP devices, its runner, PP receive/send)."""

from pipejax.worker.worker import StageInfo, StageWorker, WorkerConfig

__all__ = ["StageInfo", "StageWorker", "WorkerConfig"]
