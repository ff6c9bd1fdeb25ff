"""What pipejax's vLLM platform decides once, in the driver, for every stage worker vLLM starts: the one typed
record that travels from ``pipejax.platform_tpu.vllm_platform`` to ``pipejax.worker.vllm_worker``.

It travels in ``vllm_config.additional_config[OPTIONS_KEY]`` as a plain dict (``as_dict``), because vLLM hashes
``additional_config`` with ``json.dumps``; ``of`` turns it back into this frozen record. Imports no vLLM."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipejax.runner.config import CacheConfig, ModelSource, SchedulerConfig, StageConfig
from pipejax.worker.worker import WorkerConfig

OPTIONS_KEY = "pipejax"


@dataclasses.dataclass(frozen=True)
class VllmStageOptions:
    tensor_parallel_size: int  # each stage's own TP mesh (vLLM sees one rank per stage)
    pp_layer_partition: str | None = None  # VLLM_PP_LAYER_PARTITION, as pipejax parses it (None: even)
    # each stage process's environment by local rank on its host (its chips, or its simulated devices)
    stage_environments: tuple[Mapping[str, str], ...] = ()
    # Read by the platform from the driver's environment; the workers read none.
    compilation_cache_dir: str | None = None
    cpu_kvcache_space: float | None = None  # GiB per host on CPU; None: the default budget
    cpu_kernel_build: str = "background"
    cpu_dense_tiles: str = "auto"
    # The file the stages load where vLLM's model is a folder holding a GGUF file (None: vLLM's model itself)
    model_path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stage_environments": [dict(e) for e in self.stage_environments]}

    @classmethod
    def of(cls, additional_config: Mapping[str, Any] | None) -> VllmStageOptions | None:
        """The options the platform recorded in vLLM's ``additional_config`` (None: not recorded yet)."""
        raw = (additional_config or {}).get(OPTIONS_KEY)
        if raw is None:
            return None
        return cls(**{**raw, "stage_environments": tuple(raw.get("stage_environments", ()))})

    def worker_config(self, model: ModelSource, stage: StageConfig, cache: CacheConfig,
                      scheduler: SchedulerConfig) -> WorkerConfig:
        """The ``WorkerConfig`` of a stage vLLM hosts: vLLM's model, cache and limits, these options for the rest."""
        return WorkerConfig(
            model=model,
            stage=stage,
            tp_size=self.tensor_parallel_size,
            cache=dataclasses.replace(cache, cpu_kvcache_space=self.cpu_kvcache_space),
            scheduler=scheduler,
            compilation_cache_dir=self.compilation_cache_dir,
            cpu_kernel_build=self.cpu_kernel_build,
            cpu_dense_tiles=self.cpu_dense_tiles,
        )
