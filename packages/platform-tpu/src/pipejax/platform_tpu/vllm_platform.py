"""pipejax's platform as vLLM 0.32 sees it: a ``vllm.platforms.interface.Platform`` subclass.

The ``vllm.platform_plugins`` entry point (``plugin.register_vllm``) returns this module's class
path; vLLM imports the module only then, so nothing here runs for users without vLLM. vLLM imports
it while ``vllm.config`` is still importing: vLLM at module level, everything else late. (No torch:
pipejax's layers below the composition root never import it; vLLM brings it.)

What it decides (``check_and_update_config``): the layout is checked with pipejax's own rules
(``TpuPlatform``); tensor parallelism is taken out of vLLM's hands (vLLM sees one rank per
pipeline stage; the stage's worker owns its TP devices); the worker class, block size and each
stage's process environment (chips or simulated devices) are recorded for the workers; features
pipejax does not implement are refused by name.

Members vLLM needs although pipejax's worker uses no torch device (each found the hard way, see
the vLLM-host probe): ``device_name``/``device_type`` must be a torch device type (vLLM's gloo
process groups are built on it), ``ray_device_key`` an accelerator resource Ray lists for an actor,
``set_device`` a no-op (vLLM's output threads call it).

Under vLLM's Ray executors (``distributed_executor_backend='ray'``) the platform also carries its
environment (``FORWARDED_ENV``) to the Ray workers in vLLM's ``ParallelConfig.ray_runtime_env``, and in CPU
mode has the cluster vLLM will use checked for ``ray_device_key`` first (``RAY_CHECKS_GROUP``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm.config import VllmConfig

    from pipejax.worker.vllm_options import VllmStageOptions

log = logging.getLogger(__name__)

WORKER_CLS = "pipejax.worker.vllm_worker.VllmStageWorker"
SUPPORTED_VLLM = "0.32.0"
# Passed to vLLM's Ray workers with the driver's values (vLLM copies these names). The compilation cache
# folder is not among them: the platform reads PIPEJAX_COMPILATION_CACHE_DIR here and records it in the options.
FORWARDED_ENV = ["PIPEJAX_PLATFORM", "XLA_FLAGS", "JAX_PLATFORMS", "VLLM_PP_LAYER_PARTITION"]
# Entry points ``check(device_key, stages)`` run before vLLM's engine core uses Ray in CPU mode: this layer imports
# no Ray, pipejax-ray-executor registers the check (``pipejax.ray_executor.vllm_ray.check_cluster``).
RAY_CHECKS_GROUP = "pipejax.vllm_ray_checks"


class PipejaxPlatform(Platform):
    """vLLM's view of pipejax: TPU hosts, or JAX's CPU backend with simulated devices."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"  # torch device type of vLLM's control-plane process groups (gloo)
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    # One per stage actor. Never "CPU", even on a CPU host: vLLM's Ray executors pass the key in an actor's
    # resources= (Ray refuses CPU there) and read get_accelerator_ids()[key] (no CPU entry), so a CPU host's
    # cluster declares TPU: ray start --resources '{"TPU": N}'.
    ray_device_key = "TPU"
    device_control_env_var = "TPU_VISIBLE_CHIPS"
    ray_noset_device_env_vars = ["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"]  # the stage sets its own chips
    simple_compile_backend = "eager"  # nothing of pipejax runs through torch.compile
    # quantization= names pipejax's loader takes (``vllm_quantization``); vLLM refuses the others itself
    supported_quantization = ["int8", "int4", "gguf"]

    @property
    def supported_dtypes(self) -> list:
        """The dtypes pipejax computes in; the first is what vLLM's dtype="auto" gives a float32 checkpoint: float32
        on a CPU host (pipejax's CPU kernels run in float32 only; vLLM's default order would give bfloat16), bfloat16
        on TPU."""
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # this layer imports no torch itself

        order = ("bfloat16", "float32") if _pipejax_platform().is_tpu() else ("float32", "bfloat16")
        return [STR_DTYPE_TO_TORCH_DTYPE[name] for name in order]

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        from pipejax.platform_tpu import vllm_gguf, vllm_quantization

        vllm_quantization.register()
        vllm_gguf.install()  # model="file.gguf"
    additional_env_vars = FORWARDED_ENV

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        refuse_unsupported_config(vllm_config)
        pc, cache, sched = vllm_config.parallel_config, vllm_config.cache_config, vllm_config.scheduler_config
        if pc.distributed_executor_backend == "external_launcher":
            raise ValueError("pipejax does not support distributed_executor_backend='external_launcher'; "
                             "use 'uni', 'mp' or 'ray'")
        from pipejax.worker.vllm_options import OPTIONS_KEY, VllmStageOptions

        if VllmStageOptions.of(vllm_config.additional_config) is None:
            # first call (the config is checked again in each process that rebuilds it)
            opts = plan_stages(pc.pipeline_parallel_size, pc.tensor_parallel_size, pc.distributed_executor_backend,
                               os.environ)
            from pipejax.platform_tpu.vllm_gguf import stage_model_path

            opts = dataclasses.replace(opts, model_path=stage_model_path(vllm_config.model_config.model))
            vllm_config.additional_config = {**(vllm_config.additional_config or {}), OPTIONS_KEY: opts.as_dict()}
            # vLLM sees one rank per stage: TP is the stage's own mesh.
            pc.tensor_parallel_size = 1
            pc.world_size = pc.pipeline_parallel_size * pc.prefill_context_parallel_size
            if pc.world_size == 1 and pc.distributed_executor_backend == "mp":
                pc.distributed_executor_backend = "uni"  # one stage: run it in the engine core
            if pc.distributed_executor_backend == "ray":
                pc.ray_runtime_env = ray_runtime_env(pc.ray_runtime_env, os.environ)
                if not _pipejax_platform().is_tpu():  # CPU mode: the stages' "TPU" is a label `ray start` declares
                    check_ray_cluster(cls.ray_device_key, pc.world_size)
        if pc.worker_cls == "auto":
            pc.worker_cls = WORKER_CLS
        if cache.block_size is None:
            from pipejax.runner.config import CacheConfig

            cache.block_size = CacheConfig().block_size
        if cache.block_size & (cache.block_size - 1):
            raise ValueError(f"block_size={cache.block_size}: pipejax's paged KV cache needs a power of two, e.g. 16")
        # The worker feeds each step's tokens from the scheduler output, in order (no async overlap).
        sched.async_scheduling = False

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Per request, in vLLM's frontend: a sampling feature pipejax cannot honour is a clear error
        for that request only."""
        from vllm.exceptions import VLLMValidationError  # a client error: HTTP 400, the engine serves on

        from pipejax.worker.vllm_requests import unsupported_sampling

        if params is None or not hasattr(params, "temperature"):
            raise VLLMValidationError("pipejax serves text generation only (no pooling / embedding requests)")
        problems = unsupported_sampling(params)
        if problems:
            raise VLLMValidationError(f"pipejax does not support {', '.join(problems)}; drop them from the request")

    @classmethod
    def set_device(cls, device) -> None:
        """No torch device to select: the stage's devices are JAX's."""

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        """Sampling seeds are per request in pipejax's sampler."""

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return _pipejax_platform().get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return psutil.virtual_memory().total

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        """vLLM's TPU build has no compiled ops, and pipejax needs none."""

    @classmethod
    def get_attn_backend_cls(cls, *args, **kwargs) -> str:
        return ""  # attention is the runner's; the worker names its KV layout itself


def _pipejax_platform():
    from pipejax.platform_tpu.platform import TpuPlatform

    return TpuPlatform()


def ray_runtime_env(current, environ) -> dict:
    """vLLM's ``ParallelConfig.ray_runtime_env`` with the driver's ``FORWARDED_ENV`` among its ``env_vars``
    (values already there are kept). vLLM 0.32's engine core passes it to ``ray.init`` (``initialize_ray_cluster``:
    the job's environment, which every actor of the job inherits: the compiled-graph executor's workers) and
    RayExecutorV2 to each worker actor, so a Ray worker process starts with ``PIPEJAX_PLATFORM`` set whatever
    environment ``ray start`` had. ``additional_env_vars`` alone is too late: vLLM copies those into a worker
    only once it runs, after it has imported vLLM and resolved its platform."""
    env = dict(current or {})
    env["env_vars"] = {k: environ[k] for k in FORWARDED_ENV if k in environ} | dict(env.get("env_vars") or {})
    return env if current is None else type(current)(**env)  # a Ray RuntimeEnv stays one


def check_ray_cluster(device_key: str, stages: int) -> None:
    """Run every ``RAY_CHECKS_GROUP`` entry point: each raises when the Ray cluster vLLM will use cannot place
    ``stages`` actors of one ``device_key`` (none without pipejax-ray-executor: then vLLM's own wait)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=RAY_CHECKS_GROUP):
        ep.load()(device_key, stages)


def plan_stages(pp: int, tp: int, backend: str | None, environ: Mapping[str, str]) -> VllmStageOptions:
    """pipejax's layout check for vLLM's pp x tp, each stage process's environment by local rank, and the settings
    ``environ`` gives every stage (the platform is the edge that reads pipejax's environment under vLLM)."""
    from pipejax.pp_utils.config import ParallelConfig
    from pipejax.runner.cpu.select import cpu_dense_tiles_from_env, cpu_kernel_build_from_env
    from pipejax.worker.kv_sizing import cpu_kvcache_space_from_env
    from pipejax.worker.vllm_options import VllmStageOptions
    from pipejax.worker.worker import compilation_cache_dir_from_env

    if backend == "uni" and pp > 1:
        raise ValueError(
            f"pipeline_parallel_size={pp} with distributed_executor_backend='uni': under vLLM each pipejax "
            f"stage is its own worker process; use distributed_executor_backend='mp' (one host) or 'ray'"
        )
    platform = _pipejax_platform()
    # The layout rules of the executor asked for ('uni'/'mp': one host), then every stage placed as
    # its own process (a vLLM worker), as pipejax's Ray backend places stages.
    partition = environ.get("VLLM_PP_LAYER_PARTITION")
    asked = ParallelConfig(pp, tp, 1, partition, "ray" if backend == "ray" else "uni")
    checked = platform.check_and_update_config(asked)
    plan = platform.plan(dataclasses.replace(checked, distributed_executor_backend="ray"))
    first_host = [s.env for s in plan.stages if s.host == 0]
    log.info("pipejax under vLLM: %s", plan.describe())
    return VllmStageOptions(
        tensor_parallel_size=tp,
        pp_layer_partition=partition,
        stage_environments=tuple(first_host),  # a stage takes the one of its local rank on its host
        compilation_cache_dir=compilation_cache_dir_from_env(environ),
        cpu_kvcache_space=cpu_kvcache_space_from_env(environ),  # GiB per host on CPU; None: the default
        cpu_kernel_build=cpu_kernel_build_from_env(environ),
        cpu_dense_tiles=cpu_dense_tiles_from_env(environ),
    )


def refuse_unsupported_config(vllm_config: VllmConfig) -> None:
    """Engine-wide vLLM features pipejax's stages do not implement: a clear error naming each."""
    problems = []
    if vllm_config.lora_config is not None:
        problems.append("LoRA (enable_lora)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding (speculative_config)")
    mc = vllm_config.model_config
    if mc is not None:
        if mc.runner_type != "generate":
            problems.append(f"runner={mc.runner_type!r} (pipejax runs text generation)")
        if mc.is_multimodal_model:
            problems.append(f"multimodal model {mc.architectures}")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        problems.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}")
    pc = vllm_config.parallel_config
    if pc.prefill_context_parallel_size > 1 or pc.decode_context_parallel_size > 1:
        problems.append("context parallelism")
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV transfer / disaggregated prefill (kv_transfer_config)")
    if mc is not None and mc.logits_processors:
        problems.append(f"custom logits processors {mc.logits_processors}")
    if problems:
        raise ValueError(f"pipejax (vLLM platform {__name__}) does not support: {'; '.join(problems)}")
