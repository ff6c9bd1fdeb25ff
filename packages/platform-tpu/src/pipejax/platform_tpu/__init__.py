"""pipejax.platform_tpu: the platform plugin — device discovery, config checks, executor choice,
per-stage TPU environment. Cheap to import (no JAX)."""

from pipejax.platform_tpu.hardware import (
    GENERATIONS,
    PLATFORM_ENV,
    Hardware,
    TpuGeneration,
    TpuNotFoundError,
    cpu_hardware,
    detect_tpu_hardware,
    generation,
    parse_accelerator_type,
    resolve_mode,
    tpu_present,
)
from pipejax.platform_tpu.layout import (
    CHIP_BOUNDS,
    TPU_PORT_BASE,
    WORKER_CLS,
    LayoutError,
    Placement,
    PlatformPlan,
    check_layout,
    choose_backend,
    plan_layout,
    process_env,
)
from pipejax.platform_tpu.platform import TpuPlatform
from pipejax.platform_tpu.plugin import PLATFORM_CLASS, register, register_vllm

__all__ = [
    "CHIP_BOUNDS",
    "GENERATIONS",
    "PLATFORM_CLASS",
    "PLATFORM_ENV",
    "TPU_PORT_BASE",
    "WORKER_CLS",
    "Hardware",
    "LayoutError",
    "Placement",
    "PlatformPlan",
    "TpuGeneration",
    "TpuNotFoundError",
    "TpuPlatform",
    "check_layout",
    "choose_backend",
    "cpu_hardware",
    "detect_tpu_hardware",
    "generation",
    "parse_accelerator_type",
    "plan_layout",
    "process_env",
    "register",
    "register_vllm",
    "resolve_mode",
    "tpu_present",
]
