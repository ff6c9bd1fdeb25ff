"""Entry points: each returns the platform's class path, or None where the platform does not apply.

Cheap and idempotent: no JAX import, nothing registered globally, same answer on every call.

- ``pipejax.platform_plugins`` -> ``register``: always applies, because the platform also covers
  CPU development (which of several installed platforms runs is the engine's choice).
- ``vllm.platform_plugins`` -> ``register_vllm``: applies when the user asked for pipejax's platform
  (``PIPEJAX_PLATFORM=tpu|cpu``) or this host shows TPUs (PCI ids, ``/dev/accel*``, ``/dev/vfio/<n>``,
  ``TPU_ACCELERATOR_TYPE``). vLLM then prefers it over its built-in TPU platform. The class it names
  (``vllm_platform.PipejaxPlatform``) subclasses vLLM's ``Platform`` and imports vLLM; nothing else
  in this package does.
"""

from __future__ import annotations

import os

from pipejax.platform_tpu.hardware import MODES, PLATFORM_ENV, tpu_present

PLATFORM_CLASS = "pipejax.platform_tpu.platform.TpuPlatform"
VLLM_PLATFORM_CLASS = "pipejax.platform_tpu.vllm_platform.PipejaxPlatform"  # a vLLM Platform (needs vLLM)


def register() -> str:
    """The ``pipejax.platform_plugins`` entry point."""
    return PLATFORM_CLASS


def applies(environ=None, sys_root: str = "/sys", dev_root: str = "/dev") -> bool:
    """Whether a host framework (vLLM) should run on this platform here."""
    environ = os.environ if environ is None else environ
    if environ.get(PLATFORM_ENV, "").lower() in MODES:
        return True
    return tpu_present(environ, sys_root=sys_root, dev_root=dev_root)


def register_vllm() -> str | None:
    """The ``vllm.platform_plugins`` entry point: vLLM imports the class only when this returns it."""
    return VLLM_PLATFORM_CLASS if applies() else None
