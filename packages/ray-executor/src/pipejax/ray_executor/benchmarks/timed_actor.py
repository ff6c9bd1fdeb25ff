"""A ``StageActor`` that notes when its set-up calls start and end (wall clock), for the cold-start section."""

from __future__ import annotations

import time

from pipejax.ray_executor.executor.stage_actor import StageActor


class TimedStageActor(StageActor):
    def __init__(self):
        super().__init__()
        self.marks: dict[str, tuple[float, float]] = {"created": (time.time(), time.time())}

    def _mark(self, name: str, fn, *args):
        start = time.time()
        try:
            return fn(*args)
        finally:
            self.marks[name] = (start, time.time())

    def init_worker(self, *args):
        return self._mark("init_worker", super().init_worker, *args)

    def load(self, num_blocks: int) -> None:
        return self._mark("load", super().load, num_blocks)

    def warmup(self, batches) -> float:
        return self._mark("warmup", super().warmup, batches)

    def timings(self) -> dict[str, tuple[float, float]]:
        return self.marks
