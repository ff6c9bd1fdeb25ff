"""``TpuPlatform``: what this hardware is, and how a pp x tp x dp job is laid on it.

Constructing one is free (host frameworks instantiate the class the plugin names, with no
arguments); the hardware is detected on first use and cached. Modes:

- ``"tpu"``: TPU hosts, detected cheaply (PCI ids, device files, the TPU VM environment) with JAX's
  TPU backend as the last resort.
- ``"cpu"``: development on JAX's CPU backend with simulated devices (``XLA_FLAGS``).

The mode is ``mode=`` if given, else ``PIPEJAX_PLATFORM``, else "tpu" when a TPU is seen, else "cpu".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipejax.platform_tpu.hardware import (
    Hardware,
    cpu_hardware,
    detect_tpu_hardware,
    resolve_mode,
)
from pipejax.platform_tpu.layout import WORKER_CLS, PlatformPlan, check_layout, plan_layout

if TYPE_CHECKING:  # importing pipejax.pp_utils imports JAX; the platform only reads the config's fields
    from pipejax.pp_utils.config import ParallelConfig


class TpuPlatform:
    """pipejax's platform: TPU hosts, or simulated CPU devices for development."""

    device_name = "tpu"  # what the platform is named by (plugins, logs)
    device_type = "tpu"  # vLLM's spelling
    worker_cls = WORKER_CLS

    def __init__(
        self,
        mode: str | None = None,
        *,
        hardware: Hardware | None = None,
        num_hosts: int | None = None,
        environ: Mapping[str, str] | None = None,
        jax_fallback: bool = True,
    ):
        """``hardware`` skips detection; ``num_hosts`` overrides the host count detection finds
        (e.g. the Ray cluster's node count); ``environ`` defaults to ``os.environ`` at first use."""
        self._mode = mode
        self._hardware = hardware
        self._num_hosts = num_hosts
        self._environ = environ
        self._jax_fallback = jax_fallback

    def _env(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    @property
    def mode(self) -> str:
        """"tpu" or "cpu"."""
        if self._hardware is not None:
            return self._hardware.platform
        self._mode = resolve_mode(self._mode, self._env())
        return self._mode

    @property
    def hardware(self) -> Hardware:
        """The hosts the job can use (detected once)."""
        if self._hardware is None:
            env = self._env()
            if self.mode == "cpu":
                self._hardware = cpu_hardware(env, num_hosts=self._num_hosts or 1)
            else:
                self._hardware = detect_tpu_hardware(env, jax_fallback=self._jax_fallback, num_hosts=self._num_hosts)
        return self._hardware

    def is_tpu(self) -> bool:
        return self.mode == "tpu"

    def is_simulated(self) -> bool:
        """True in CPU development mode."""
        return self.mode == "cpu"

    @property
    def ray_device_key(self) -> str:
        """The Ray resource a stage's bundle asks for: "TPU", or "" on CPU (the executor's choice)."""
        return "TPU" if self.is_tpu() else ""

    def get_device_name(self, device_id: int = 0) -> str:
        return self.hardware.device_name()

    def devices_per_host(self) -> int:
        return self.hardware.devices_per_host

    def cores_per_chip(self) -> int:
        return self.hardware.cores_per_chip

    def check_and_update_config(self, config: ParallelConfig) -> ParallelConfig:
        """Validate pp x tp x dp against the hosts; return a new config with the executor backend chosen.

        Raises ``LayoutError`` (a ``ValueError``) whose message says what fits.
        """
        return check_layout(config, self.hardware)

    def plan(self, config: ParallelConfig) -> PlatformPlan:
        """``check_and_update_config`` plus where every stage/engine runs and its process environment."""
        return plan_layout(config, self.hardware, xla_flags=self._env().get("XLA_FLAGS", ""))

    def __repr__(self) -> str:
        detail = repr(self._hardware) if self._hardware is not None else f"mode={self._mode!r}, not detected yet"
        return f"TpuPlatform({detail})"
