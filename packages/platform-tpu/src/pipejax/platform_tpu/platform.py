"""``TpuPlatform``: what this hardware is, and how a pp x tp x dp job is laid on it.

Constructing one is free (host frameworks instantiate the class the plugin names, with no
arguments); the hardware is detected on first use and cached. Modes:

- ``"tpu"``: TPU hosts, detected cheaply (PCI ids, device files, the TPU VM environment) with JAX's
  TPU backend as the last resort.
- ``"cpu"``: development on JAX's CPU backend with simulated devices (``XLA_FLAGS``).

The mode is ``mode=`` if given, else ``PIPEJAX_PLATFORM``, else "tpu" when a TPU is seen, else "cpu".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipejax.platform_tpu.hardware import (
    Hardware,
    cpu_hardware,
    detect_host,
    detect_tpu_hardware,
    generation,
    parse_accelerator_type,
    requested_mode,
    resolve_mode,
)
from pipejax.platform_tpu.layout import (
    PlatformPlan,
    check_layout,
    driver_env,
    plan_layout,
    stage_chips,
    stage_process_env,
)

if TYPE_CHECKING:  # importing pipejax.pp_utils imports JAX; the platform only reads the config's fields
    from pipejax.pp_utils.config import ParallelConfig


RAY_ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's per-node accelerator resource, e.g. accelerator_type:TPU-V5LITEPOD


class TpuPlatform:
    """pipejax's platform: TPU hosts, or simulated CPU devices for development."""

    device_name = "tpu"  # what the platform is named by (plugins, logs)
    device_type = "tpu"  # vLLM's spelling

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
        self._mode = mode  # as asked; None: PIPEJAX_PLATFORM, else what the host has
        self._resolved_mode: str | None = None
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
        if self._resolved_mode is None:
            self._resolved_mode = resolve_mode(self._mode, self._env())
        return self._resolved_mode

    @property
    def requested_mode(self) -> str | None:
        """The mode the user asked for (``mode=`` or ``PIPEJAX_PLATFORM``); None: each host decides by
        what it has."""
        return requested_mode(self._mode, self._env())

    def detect_host(self) -> Hardware:
        """The host this process runs on (one host, cheap probes, never JAX): call it on the node a
        stage runs on. TPU where the host shows TPUs and CPU was not asked for, else simulated CPU."""
        return detect_host(self.requested_mode, self._env())

    def stage_environment(self, host: Hardware, chips: tuple[int, ...], tp: int) -> dict[str, str]:
        """The process environment of a stage of ``tp`` devices granted ``chips`` of ``host`` (a
        ``detect_host`` result from the stage's node). Raises ``LayoutError`` for chips out of box."""
        return stage_process_env(host, tuple(chips), tp, xla_flags=self._env().get("XLA_FLAGS", ""))

    def stage_chips(self, tp: int, host: Hardware) -> int:
        """Chips a stage of ``tp`` devices owns on ``host`` (simulated devices on CPU); ``LayoutError``
        when ``tp`` does not fill whole chips or fit the host."""
        return stage_chips(tp, host)

    @staticmethod
    def ray_node_hardware(resources: Mapping[str, float]) -> Hardware | None:
        """A TPU host as a Ray node lists it (its ``TPU`` chips and ``accelerator_type:TPU-<gen>``
        resource), or None when the node lists no TPU or no generation."""
        chips = int(resources.get("TPU", 0))
        kinds = [k.removeprefix(RAY_ACCELERATOR_PREFIX) for k in resources if k.startswith(RAY_ACCELERATOR_PREFIX)]
        tpu_kinds = [k for k in kinds if k.upper().startswith("TPU")]
        if chips < 1 or not tpu_kinds:
            return None
        return Hardware("tpu", 1, chips, generation=generation(tpu_kinds[0]).name)

    @staticmethod
    def ray_slice_heads(resources: Mapping[str, float]) -> list[str]:
        """The ``TPU-<pod type>-head`` resources of multi-host slices a Ray node lists (Ray gives one to
        worker 0 of every slice; a job that spans a slice's hosts holds it, as Ray's own slice
        reservations do)."""
        heads = []
        for key in sorted(resources):
            if key.startswith("TPU-") and key.endswith("-head"):
                try:
                    gen, chips = parse_accelerator_type(key.removeprefix("TPU-").removesuffix("-head"))
                except ValueError:
                    continue
                if chips > gen.chips_per_host:  # a single-host slice's head is just its host
                    heads.append(key)
        return heads

    def engine_environment(self, config: ParallelConfig, local_index: int, local_count: int) -> dict[str, str]:
        """The environment of the ``local_index``-th of ``local_count`` engine processes this host starts
        (``PlatformPlan.engines``): disjoint chip boxes on TPU; on CPU each simulates its own devices."""
        if self.is_simulated():
            plan = self.plan(dataclasses.replace(config, data_parallel_size=1))
            return plan.engine(0).env
        one_host = dataclasses.replace(self.hardware, num_hosts=1)
        plan = plan_layout(dataclasses.replace(config, data_parallel_size=local_count), one_host)
        return plan.engine(local_index).env

    def driver_environment(self, pp: int, tp: int, backend: str | None) -> dict[str, str]:
        """What the engine's own process sets before JAX loads (plain sizes: the CLI calls this before
        importing any config): its chips under 'uni', JAX's CPU backend under 'ray'."""
        return driver_env(self.hardware, pp, tp, backend, xla_flags=self._env().get("XLA_FLAGS", ""))

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
