"""Backend name -> executor; Ray is imported only when Ray is chosen."""

from __future__ import annotations

from typing import Any

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.executor.base import Executor


def create_executor(config: EngineConfig, placement_group: Any = None) -> Executor:
    """The executor of ``distributed_executor_backend``: None or 'uni' in-process, 'ray' on Ray (its stage
    actors in ``placement_group`` when the caller created one; the in-process executor has no actors to place)."""
    backend = config.parallel.distributed_executor_backend
    if backend in (None, "uni"):
        from pipejax.ray_executor.executor.inprocess import InProcessExecutor

        return InProcessExecutor(config)
    if backend == "ray":
        from pipejax.ray_executor.executor.ray_executor import RayExecutor

        return RayExecutor(config, placement_group)
    raise ValueError(f"unknown distributed_executor_backend={backend!r}; use 'uni' or 'ray'")
