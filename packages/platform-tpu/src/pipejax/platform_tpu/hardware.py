"""What the job is laid on: TPU generations, the ``Hardware`` description, and how to detect it.

Everything here is cheap to import (no JAX). Detection reads, in order of cost: PCI ids under
``/sys/bus/pci/devices`` (generation and local chip count), ``/dev/accel*`` / ``/dev/vfio/<n>`` of a
Google device (chip count), the TPU VM / GKE environment (``TPU_ACCELERATOR_TYPE``, ``TPU_WORKER_HOSTNAMES``),
and only when those leave the generation unknown, JAX's TPU backend (which opens the chips in
this process). Environment variables are read here and in ``platform.py`` only.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

PLATFORM_ENV = "PIPEJAX_PLATFORM"
MODES = ("tpu", "cpu")
DEFAULT_CPU_DEVICES = 8  # simulated devices per host when XLA_FLAGS does not say
MULTI_HOST_CHIPS_PER_HOST = 4  # every generation's multi-host slices are built of 4-chip hosts
GOOGLE_PCI_VENDOR = "0x1ae0"
_FORCE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation, as a host of it looks to JAX."""

    name: str
    cores_per_chip: int  # TensorCores JAX shows as separate devices; megacore chips (v4, v5p) count 1
    chips_per_host: int  # chips of a full host
    type_counts_cores: bool  # the accelerator type's number counts TensorCores (v4-8 = 4 chips), not chips
    # Per-chip figures for planning layouts (`pipejax plan`): v5e and v6e as Cloud TPU's pages list them (read
    # 2026-12-04); the other generations' as recalled from those pages, not re-read: check before relying on them
    hbm_gb: float = 0.0  # HBM per chip, 1e9 bytes
    bf16_tflops: float = 0.0  # peak bf16 matmul rate per chip
    hbm_gb_s: float = 0.0  # HBM bandwidth per chip, 1e9 bytes/s


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v2", 2, 4, True, hbm_gb=17.2, bf16_tflops=45, hbm_gb_s=700),
        TpuGeneration("v3", 2, 4, True, hbm_gb=34.4, bf16_tflops=123, hbm_gb_s=900),
        TpuGeneration("v4", 1, 4, True, hbm_gb=34.4, bf16_tflops=275, hbm_gb_s=1228),
        TpuGeneration("v5p", 1, 4, True, hbm_gb=95, bf16_tflops=459, hbm_gb_s=2765),
        TpuGeneration("v5e", 1, 8, False, hbm_gb=16, bf16_tflops=197, hbm_gb_s=819),
        TpuGeneration("v6e", 1, 8, False, hbm_gb=32, bf16_tflops=918, hbm_gb_s=1640),
        TpuGeneration("v7x", 2, 4, True, hbm_gb=192, bf16_tflops=2307, hbm_gb_s=7370),
    )
}
# PCI device id -> generation (v2 and v3 share 0x0027 and differ by subsystem id).
_PCI_DEVICE_IDS = {"0x005e": "v4", "0x0063": "v5e", "0x0062": "v5p", "0x006f": "v6e", "0x0076": "v7x"}
_PCI_V2_V3_SUBSYSTEMS = {"0x004e": "v2", "0x004f": "v3"}
_NAME_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e", "7x": "v7x", "v7": "v7x"}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Identical hosts of chips. On CPU a "chip" is one simulated device (``cores_per_chip`` 1)."""

    platform: str  # "tpu" | "cpu"
    num_hosts: int = 1
    chips_per_host: int = DEFAULT_CPU_DEVICES
    cores_per_chip: int | None = None  # None: the generation's (1 on CPU)
    generation: str | None = None  # "v5e", ...; None on CPU
    host_addresses: tuple[str, ...] = ()  # TPU_WORKER_HOSTNAMES, when known

    def __post_init__(self):
        if self.platform not in MODES:
            raise ValueError(f"platform={self.platform!r} is not one of {', '.join(MODES)}")
        gen = GENERATIONS.get(self.generation) if self.generation else None
        if self.generation and gen is None:
            raise ValueError(f"generation={self.generation!r} is not one of {', '.join(GENERATIONS)}")
        if self.cores_per_chip is None:
            object.__setattr__(self, "cores_per_chip", gen.cores_per_chip if gen else 1)
        elif gen and self.cores_per_chip != gen.cores_per_chip:
            raise ValueError(
                f"cores_per_chip={self.cores_per_chip}, but a TPU {gen.name} chip shows {gen.cores_per_chip} devices"
            )
        for name in ("num_hosts", "chips_per_host", "cores_per_chip"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Hardware.{name}={value!r} must be an integer >= 1")

    @property
    def devices_per_host(self) -> int:
        return self.chips_per_host * self.cores_per_chip

    @property
    def total_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def describe(self) -> str:
        """E.g. ``2 TPU v5e hosts x 8 chips x 1 core = 16 devices``."""
        hosts = f"{self.num_hosts} {self.device_name()} host{'s' if self.num_hosts > 1 else ''}"
        if self.platform == "cpu":
            return f"{hosts} x {self.devices_per_host} simulated devices = {self.total_devices} devices"
        cores = f"{self.cores_per_chip} core{'s' if self.cores_per_chip > 1 else ''}"
        return f"{hosts} x {self.chips_per_host} chips x {cores} = {self.total_devices} devices"

    def device_name(self) -> str:
        if self.platform == "cpu":
            return "CPU (simulated devices)"
        return f"TPU {self.generation}" if self.generation else "TPU"


class TpuNotFoundError(RuntimeError):
    """TPU mode was asked for, but this machine shows no TPU."""


def generation(name: str) -> TpuGeneration:
    """``"v5litepod"``, ``"TPU v5 lite"``, ``"tpu7x"``, ``"v6e"`` ... -> the generation."""
    key = name.strip().lower().removeprefix("tpu").strip(" -_")
    key = key.replace(" ", "")  # "v5 lite" -> "v5lite"
    key = _NAME_ALIASES.get(key, key)
    if key == "v5":  # JAX's device_kind for v5p is "TPU v5"
        key = "v5p"
    if key not in GENERATIONS:
        raise ValueError(f"unknown TPU generation {name!r}; known: {', '.join(GENERATIONS)}")
    return GENERATIONS[key]


def parse_accelerator_type(accelerator_type: str) -> tuple[TpuGeneration, int]:
    """``"v4-16"`` -> (v4, 8 chips); ``"v5litepod-16"`` -> (v5e, 16 chips)."""
    name, sep, size = accelerator_type.strip().rpartition("-")
    if not sep or not size.isdigit() or int(size) < 1:
        raise ValueError(f"accelerator type {accelerator_type!r} is not <generation>-<size>, e.g. 'v5litepod-8'")
    gen = generation(name)
    count = int(size)
    chips = count // 2 if gen.type_counts_cores else count
    return gen, max(chips, 1)


def parse_host_device_count(xla_flags: str) -> int | None:
    """The ``--xla_force_host_platform_device_count`` in ``xla_flags``, if any."""
    found = _FORCE_COUNT.findall(xla_flags or "")
    return int(found[-1]) if found else None


def with_host_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` with the simulated CPU device count set to ``count`` (other flags kept)."""
    kept = _FORCE_COUNT.sub("", xla_flags or "").split()
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def probe_pci(sys_root: str = "/sys") -> tuple[TpuGeneration | None, int]:
    """(generation, chips) of the Google TPUs on this host's PCI bus; (None, 0) when none."""
    found: dict[str, int] = {}
    for dev in sorted((Path(sys_root) / "bus" / "pci" / "devices").glob("*")):
        if _read(dev / "vendor") != GOOGLE_PCI_VENDOR:
            continue
        device_id = _read(dev / "device")
        name = _PCI_DEVICE_IDS.get(device_id)
        if device_id == "0x0027":
            name = _PCI_V2_V3_SUBSYSTEMS.get(_read(dev / "subsystem_device"))
        if name:
            found[name] = found.get(name, 0) + 1
    if not found:
        return None, 0
    name = max(found, key=found.get)
    return GENERATIONS[name], found[name]


def probe_device_files(dev_root: str = "/dev", sys_root: str = "/sys") -> int:
    """Chips visible as ``/dev/accel<n>`` character devices, or as ``/dev/vfio/<group>`` whose IOMMU
    group holds a Google device (other VFIO groups, e.g. a passed-through GPU or NIC, are not TPUs)."""
    root = Path(dev_root)
    accel = [p for p in root.glob("accel*") if p.name[5:].isdigit() and not p.is_dir()]
    if accel:
        return len(accel)
    groups = Path(sys_root) / "kernel" / "iommu_groups"
    return sum(
        1
        for p in (root / "vfio").glob("*")
        if p.name.isdigit() and any(_read(v) == GOOGLE_PCI_VENDOR for v in (groups / p.name).glob("devices/*/vendor"))
    )


def tpu_present(environ: Mapping[str, str] = os.environ, sys_root: str = "/sys", dev_root: str = "/dev") -> bool:
    """Cheap: does this host look like a TPU host (PCI ids, device files or the TPU VM environment)?"""
    if environ.get("TPU_ACCELERATOR_TYPE"):
        return True
    if probe_pci(sys_root)[1]:
        return True
    return probe_device_files(dev_root, sys_root) > 0


def resolve_mode(explicit: str | None, environ: Mapping[str, str] = os.environ, **probe_roots: str) -> str:
    """``explicit`` (config) > ``PIPEJAX_PLATFORM`` > "tpu" when a TPU is seen > "cpu" (development)."""
    return requested_mode(explicit, environ) or ("tpu" if tpu_present(environ, **probe_roots) else "cpu")


def requested_mode(explicit: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The mode the user asked for (``explicit`` > ``PIPEJAX_PLATFORM``), or None: detect per host."""
    for source, value in (("mode", explicit), (PLATFORM_ENV, environ.get(PLATFORM_ENV))):
        if value:
            if value.lower() not in MODES:
                raise ValueError(f"{source}={value!r} is not a platform mode: use 'tpu' or 'cpu' (development)")
            return value.lower()
    return None


def detect_host(explicit: str | None = None, environ: Mapping[str, str] = os.environ, **probe_roots: str) -> Hardware:
    """This one host, cheaply (never JAX: the caller may not have set its chips yet): its TPUs when it
    shows any (and CPU was not asked for), else simulated CPU devices. ``num_hosts`` is 1."""
    if resolve_mode(explicit, environ, **probe_roots) == "cpu":
        return cpu_hardware(environ)
    return detect_tpu_hardware(environ, jax_fallback=False, num_hosts=1, **probe_roots)


def cpu_hardware(environ: Mapping[str, str] = os.environ, num_hosts: int = 1) -> Hardware:
    """Simulated CPU devices: as many per host as ``XLA_FLAGS`` forces, else ``DEFAULT_CPU_DEVICES``."""
    count = parse_host_device_count(environ.get("XLA_FLAGS", "")) or DEFAULT_CPU_DEVICES
    return Hardware("cpu", num_hosts=num_hosts, chips_per_host=count)


def _jax_tpu_devices() -> tuple[str, int]:
    """(device_kind, local device count) from JAX's TPU backend. Opens the chips in this process."""
    import jax  # only here: importing JAX is what plugin loaders must not pay for

    devices = jax.local_devices(backend="tpu")
    return devices[0].device_kind, len(devices)


def detect_tpu_hardware(
    environ: Mapping[str, str] = os.environ,
    *,
    sys_root: str = "/sys",
    dev_root: str = "/dev",
    jax_fallback: bool = True,
    num_hosts: int | None = None,
) -> Hardware:
    """This TPU slice: generation, chips per host, hosts. Raises ``TpuNotFoundError`` when there is none."""
    gen, chips = probe_pci(sys_root)
    chips = chips or probe_device_files(dev_root, sys_root)
    total_chips = None
    if accelerator_type := environ.get("TPU_ACCELERATOR_TYPE"):
        typed_gen, total_chips = parse_accelerator_type(accelerator_type)
        gen = gen or typed_gen
    if gen is None and jax_fallback:
        try:
            kind, devices = _jax_tpu_devices()
        except Exception as e:  # no TPU backend: libtpu missing, or no chip
            raise TpuNotFoundError(_not_found(f"JAX's TPU backend failed: {e}")) from e
        gen = generation(kind)
        chips = chips or devices // gen.cores_per_chip
    if gen is None:
        raise TpuNotFoundError(_not_found("the JAX fallback was off"))
    if not chips:  # no local probe: a single-host slice is all its chips, a multi-host slice has 4 per host
        total = total_chips or gen.chips_per_host
        chips = total if total <= gen.chips_per_host else MULTI_HOST_CHIPS_PER_HOST
    chips_per_host = chips
    hostnames = tuple(h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip())
    if num_hosts is None:
        if len(hostnames) > 1:
            num_hosts = len(hostnames)
        elif total_chips:
            num_hosts = max(1, math.ceil(total_chips / chips_per_host))
        else:
            num_hosts = 1
    return Hardware("tpu", num_hosts, chips_per_host, gen.cores_per_chip, gen.name, hostnames)


def _not_found(why: str) -> str:
    return (
        "no TPU found: no Google PCI device (vendor 0x1ae0) under /sys/bus/pci/devices, no /dev/accel* "
        f"or /dev/vfio/<n>, TPU_ACCELERATOR_TYPE unset, and {why}. On a TPU VM install the extra "
        f"'pipejax-platform-tpu[tpu]' (libtpu); for development without TPUs set {PLATFORM_ENV}=cpu"
    )
