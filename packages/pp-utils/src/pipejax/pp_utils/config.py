"""The parallel layout of a job, shared by every layer that needs it (frozen; vary with ``dataclasses.replace``)."""

from __future__ import annotations

import dataclasses

EXECUTOR_BACKENDS = ("uni", "ray")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """pp x tp per engine, dp engines; ``distributed_executor_backend`` None = let the platform choose."""

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pp_layer_partition: str | tuple[int, ...] | None = None
    # Mixture-of-Experts layers: each tp device holds num_experts / tp whole experts (vLLM's
    # --enable-expert-parallel); off, each expert's FFN is split over the tp devices like a dense MLP.
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None

    def __post_init__(self):
        sizes = {
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not one of {', '.join(EXECUTOR_BACKENDS)}"
            )

    @property
    def world_size(self) -> int:
        """Devices one engine uses: pp x tp."""
        return self.pipeline_parallel_size * self.tensor_parallel_size
