"""From the command line's engine arguments to the engine: simulated CPU devices for the layout, and
the ``EngineConfig`` (shared by ``pipejax generate``, ``bench throughput`` and ``serve``).

Imports nothing JAX-related at module level: the CLI calls ``configure_devices`` before JAX loads.
"""

from __future__ import annotations

import argparse
import os


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


def engine_config_from_args(args: argparse.Namespace, backend: str | None = None, **overrides):
    """The ``EngineConfig`` the engine arguments (``cli._add_engine_args``) describe; the one mapping that
    ``generate``, ``bench throughput`` and ``serve`` share. ``backend`` overrides the executor backend."""
    from pipejax.pp_utils import ParallelConfig
    from pipejax.ray_executor.config import EngineConfig
    from pipejax.ray_executor.llm import resolve_model
    from pipejax.runner.config import CacheConfig

    return EngineConfig(
        model=resolve_model(args.model),
        parallel=ParallelConfig(
            pipeline_parallel_size=args.pipeline_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            pp_layer_partition=args.pp_layer_partition,
            distributed_executor_backend=backend or args.distributed_executor_backend,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        dtype=args.dtype,
        seed=args.seed,
        model_impl=args.model_impl,
        ray_compiled_graph=args.ray_compiled_graph,
        pin_stage_cpus=args.pin_stage_cpus,
        **overrides,
    )
