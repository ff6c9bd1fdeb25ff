"""Backend name -> executor class; Ray is imported only when Ray is chosen."""

from __future__ import annotations

from pipejax.ray_executor.executor.base import Executor


def executor_class(backend: str | None) -> type[Executor]:
    """The executor of ``distributed_executor_backend``: None or 'uni' in-process, 'ray' on Ray."""
    if backend in (None, "uni"):
        from pipejax.ray_executor.executor.inprocess import InProcessExecutor

        return InProcessExecutor
    if backend == "ray":
        from pipejax.ray_executor.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend={backend!r}; use 'uni' or 'ray'")
