"""Laying pp x tp x dp on hosts: which chips each stage and engine owns, and its process environment.

Pure functions of a ``ParallelConfig`` and a ``Hardware`` (no JAX, no environment reads). The rules:

- A stage (``tp`` devices) never spans hosts. On TPU it owns whole chips, ``ceil(tp / cores_per_chip)``,
  and a process can own 1, 2, 4 or 8 chips of a host: the boxes ``TPU_CHIPS_PER_PROCESS_BOUNDS`` names.
- An engine (``pp`` stages) that fits on one host stays there: it owns the smallest box holding its
  stages, its stages own consecutive chips of that box, and engines fill hosts in order. An engine that
  does not fit spans hosts stage by stage (that needs the Ray backend); stages fill hosts in order.
- Every process is its own single-process JAX cluster (``TPU_PROCESS_BOUNDS=1,1,1``, task 0, its own
  port), so processes on one host get disjoint chips and ports.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from pipejax.platform_tpu.hardware import Hardware, with_host_device_count

if TYPE_CHECKING:  # importing pipejax.pp_utils imports JAX; the platform only reads the config's fields
    from pipejax.pp_utils.config import ParallelConfig

# chips of one process -> TPU_CHIPS_PER_PROCESS_BOUNDS (as JAX's own multi-process TPU tests lay them out)
CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_PORT_BASE = 8476  # libtpu's default TPU_PROCESS_PORT; a process uses TPU_PORT_BASE + its first chip


class LayoutError(ValueError):
    """A pp x tp x dp layout that does not fit the hardware; the message says what fits."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """One process's share of a host: a stage (Ray backend) or a whole engine (in-process backend)."""

    dp_rank: int
    pp_rank: int | None  # None: a whole engine
    host: int  # 0 = the driver's host, then in order
    chips: tuple[int, ...]  # host-local chip ids (simulated device ids on CPU); () = holds no device
    environment: tuple[tuple[str, str], ...]  # what to set before JAX is imported in that process

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


@dataclasses.dataclass(frozen=True)
class PlatformPlan:
    """A checked layout: the config (backend chosen) and every process's environment."""

    parallel: ParallelConfig
    hardware: Hardware
    stages: tuple[Placement, ...]  # stages[dp_rank * pp + pp_rank]
    engines: tuple[Placement, ...]  # engines[dp_rank]: its chips under 'uni'; none under 'ray'

    @property
    def backend(self) -> str:
        return self.parallel.distributed_executor_backend

    @property
    def hosts_used(self) -> int:
        return 1 + max(p.host for p in self.stages)

    def stage(self, dp_rank: int, pp_rank: int) -> Placement:
        return self.stages[dp_rank * self.parallel.pipeline_parallel_size + pp_rank]

    def engine(self, dp_rank: int) -> Placement:
        return self.engines[dp_rank]

    def describe(self) -> str:
        lines = [f"{self.hardware.describe()}; backend {self.backend!r}, {self.hosts_used} host(s) used"]
        for p in self.stages:
            lines.append(f"  dp {p.dp_rank} pp {p.pp_rank}: host {p.host} chips {list(p.chips)}")
        return "\n".join(lines)


def stage_chips(tp: int, hw: Hardware) -> int:
    """Chips one stage owns (validated: whole chips, a box that one host holds)."""
    if tp > hw.devices_per_host:
        raise LayoutError(
            f"tensor_parallel_size={tp} does not fit one host: a stage never spans hosts, and "
            f"{_host(hw)}. Fits: tensor_parallel_size in {_tp_choices(hw)} "
            f"(raise pipeline_parallel_size to use more hosts)"
        )
    if hw.platform == "cpu":
        return tp
    cores = hw.cores_per_chip
    if tp > cores and tp % cores:
        raise LayoutError(
            f"tensor_parallel_size={tp} does not fill whole chips: a {hw.device_name()} chip is {cores} "
            f"devices (TensorCores). Fits: tensor_parallel_size in {_tp_choices(hw)}"
        )
    chips = math.ceil(tp / cores)
    if chips not in CHIP_BOUNDS:
        raise LayoutError(
            f"tensor_parallel_size={tp} needs {chips} chips per stage, but a TPU process owns 1, 2, 4 or 8 "
            f"chips of a host (TPU_CHIPS_PER_PROCESS_BOUNDS). Fits: tensor_parallel_size in {_tp_choices(hw)}"
        )
    return chips


def hosts_needed(pp: int, tp: int, dp: int, hw: Hardware) -> int:
    """Hosts the layout occupies (after ``stage_chips`` validated ``tp``)."""
    per_stage = stage_chips(tp, hw)
    if engine_fits_host(pp, tp, hw):
        per_host = hw.chips_per_host // _box(pp * per_stage, hw)
        return math.ceil(dp / per_host)
    return math.ceil(dp * pp / (hw.chips_per_host // per_stage))


def engine_fits_host(pp: int, tp: int, hw: Hardware) -> bool:
    return pp * stage_chips(tp, hw) <= hw.chips_per_host


def choose_backend(config: ParallelConfig, hw: Hardware) -> str:
    """'uni' (every stage in this process) when an engine fits one host, 'ray' when it spans hosts.

    An explicit ``distributed_executor_backend`` wins, except 'uni' for an engine that spans hosts.
    """
    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    fits = engine_fits_host(pp, tp, hw)
    asked = config.distributed_executor_backend
    if asked == "uni" and not fits:
        raise LayoutError(
            f"distributed_executor_backend='uni' runs every stage in one process on one host, but "
            f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} needs {pp * stage_chips(tp, hw)} "
            f"chips and {_host(hw)}. Use distributed_executor_backend='ray' (or leave it unset to let "
            f"the platform choose), or a layout of at most {hw.devices_per_host} devices per engine"
        )
    return asked or ("uni" if fits else "ray")


def check_layout(config: ParallelConfig, hw: Hardware) -> ParallelConfig:
    """Validate ``config`` against ``hw``; return it with the executor backend chosen (a new config)."""
    pp, tp, dp = config.pipeline_parallel_size, config.tensor_parallel_size, config.data_parallel_size
    stage_chips(tp, hw)
    need = hosts_needed(pp, tp, dp, hw)
    if need > hw.num_hosts:
        raise LayoutError(
            f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} x data_parallel_size={dp} needs "
            f"{need} hosts ({_packing(pp, tp, hw)}), but this is {hw.describe()}. {_what_fits(pp, tp, dp, hw)}"
        )
    return dataclasses.replace(config, distributed_executor_backend=choose_backend(config, hw))


def plan_layout(config: ParallelConfig, hw: Hardware, *, xla_flags: str = "") -> PlatformPlan:
    """Check ``config`` and place every stage and engine; ``xla_flags`` are kept in CPU processes' XLA_FLAGS."""
    config = check_layout(config, hw)
    pp, tp, dp = config.pipeline_parallel_size, config.tensor_parallel_size, config.data_parallel_size
    per_stage = stage_chips(tp, hw)
    stages, engines = [], []
    if engine_fits_host(pp, tp, hw):
        box = _box(pp * per_stage, hw)
        for e in range(dp):
            host, slot = divmod(e, hw.chips_per_host // box)
            first = slot * box
            engines.append((e, None, host, range(first, first + box), pp * tp))
            for p in range(pp):
                start = first + p * per_stage
                stages.append((e, p, host, range(start, start + per_stage), tp))
    else:
        for g in range(dp * pp):
            host, slot = divmod(g, hw.chips_per_host // per_stage)
            stages.append((*divmod(g, pp), host, range(slot * per_stage, (slot + 1) * per_stage), tp))
    if config.distributed_executor_backend == "ray":  # the driver holds no device; its stages do
        engines = [(e, None, stages[e * pp][2], (), 0) for e in range(dp)]

    def place(dp_rank, pp_rank, host, chips, devices) -> Placement:
        env = process_env(hw, tuple(chips), devices, xla_flags=xla_flags)
        return Placement(dp_rank, pp_rank, host, tuple(chips), tuple(sorted(env.items())))

    return PlatformPlan(
        config, hw, tuple(place(*s) for s in stages), tuple(place(*e) for e in engines)
    )


def process_env(hw: Hardware, chips: tuple[int, ...], devices: int, *, xla_flags: str = "") -> dict[str, str]:
    """The environment of a process owning ``chips`` of its host (``devices`` JAX devices used).

    TPU: the chips, a single-process JAX cluster on its own port. CPU: ``devices`` simulated devices.
    A process with no chips (a Ray driver) gets JAX's CPU backend, so it never opens a TPU.
    """
    if hw.platform == "cpu" or not chips:
        env = {"JAX_PLATFORMS": "cpu"}
        if devices:
            env["XLA_FLAGS"] = with_host_device_count(xla_flags, devices)
        return env
    # A whole host of an unusual size (no box for it) keeps libtpu's own bounds for the host.
    bounds = CHIP_BOUNDS.get(len(chips), "")
    port = str(TPU_PORT_BASE + chips[0])
    env = {
        # The host's own backend (CPU stays available for host-side arrays): never the CPU alone.
        "JAX_PLATFORMS": "tpu,cpu",
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in chips),
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
        "TPU_PROCESS_PORT": port,
        "CLOUD_TPU_TASK_ID": "0",
        # Older libtpu spellings of the two bounds (what Ray sets), and the slice's own worker list
        # (set on GKE multi-host slices), narrowed to this one process.
        "TPU_HOST_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_HOST_BOUNDS": bounds,
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "localhost",
        # Ray would overwrite TPU_VISIBLE_CHIPS with the ids of the TPU resources it granted.
        "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS": "1",
    }
    if len(chips) < hw.chips_per_host:  # other processes may hold the rest of this host's chips
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    return {k: v for k, v in env.items() if v}


def stage_process_env(hw: Hardware, chips: tuple[int, ...], tp: int, *, xla_flags: str = "") -> dict[str, str]:
    """The environment of a stage of ``tp`` devices that was granted ``chips`` of a host like ``hw``
    (e.g. by Ray's ``TPU`` resource ids). On TPU the chips must be the stage's whole box: as many as
    ``stage_chips`` says, consecutive, starting at a multiple of their count, on the host."""
    if hw.platform == "tpu":
        want = stage_chips(tp, hw)
        aligned = len(chips) == want and chips == tuple(range(chips[0], chips[0] + want)) and chips[0] % want == 0
        if not aligned or chips[-1] >= hw.chips_per_host:
            raise LayoutError(
                f"a stage of tensor_parallel_size={tp} on a {hw.device_name()} host needs {want} consecutive chips "
                f"starting at a multiple of {want} (one TPU_CHIPS_PER_PROCESS_BOUNDS box of the host's "
                f"{hw.chips_per_host}), but was granted chips {list(chips)}. Other work on that host holds "
                f"chips out of line: give the job whole hosts, or use a tensor_parallel_size whose box fits"
            )
    return process_env(hw, chips, tp, xla_flags=xla_flags)


def driver_env(hw: Hardware, pp: int, tp: int, backend: str | None, *, xla_flags: str = "") -> dict[str, str]:
    """The environment of the process that runs an engine of pp x tp (dp rank 0 of this host): its box of
    chips under 'uni' (the platform's choice when the engine fits the host); under 'ray' JAX's CPU backend
    alone, since the stages own the chips."""
    if (backend or ("uni" if engine_fits_host(pp, tp, hw) else "ray")) == "ray":
        return process_env(hw, (), 0)
    box = _box(pp * stage_chips(tp, hw), hw)
    return process_env(hw, tuple(range(box)), pp * tp, xla_flags=xla_flags)


def _box(chips: int, hw: Hardware) -> int:
    """Chips an engine of ``chips`` occupies: itself on CPU, the smallest process box on TPU."""
    if hw.platform == "cpu":
        return chips
    return min((b for b in CHIP_BOUNDS if chips <= b <= hw.chips_per_host), default=hw.chips_per_host)


def _host(hw: Hardware) -> str:
    if hw.platform == "cpu":
        return f"a host has {hw.devices_per_host} simulated devices (XLA_FLAGS=--xla_force_host_platform_device_count)"
    per_chip = f"{hw.cores_per_chip} device{'s' if hw.cores_per_chip > 1 else ''} per chip"
    return f"a {hw.device_name()} host has {hw.chips_per_host} chips x {per_chip} = {hw.devices_per_host} devices"


def _tp_choices(hw: Hardware) -> str:
    if hw.platform == "cpu":
        return f"1..{hw.devices_per_host}"
    sizes = {1} | {c * hw.cores_per_chip for c in CHIP_BOUNDS if c <= hw.chips_per_host}
    return ", ".join(str(s) for s in sorted(sizes))


def _packing(pp: int, tp: int, hw: Hardware) -> str:
    per_stage = stage_chips(tp, hw)
    unit = "devices" if hw.platform == "cpu" else "chips"
    if engine_fits_host(pp, tp, hw):
        box = _box(pp * per_stage, hw)
        return f"{hw.chips_per_host // box} engine(s) of {box} {unit} per host"
    return f"{hw.chips_per_host // per_stage} stage(s) of {per_stage} {unit} per host"


def _what_fits(pp: int, tp: int, dp: int, hw: Hardware) -> str:
    def fits(p: int, d: int) -> bool:
        return hosts_needed(p, tp, d, hw) <= hw.num_hosts

    limit = hw.total_devices
    max_dp = max((d for d in range(1, limit + 1) if fits(pp, d)), default=0)
    max_pp = max((p for p in range(1, limit + 1) if fits(p, dp)), default=0)
    options = []
    if max_dp:
        options.append(f"data_parallel_size <= {max_dp} with pipeline_parallel_size={pp}")
    if max_pp:
        options.append(f"pipeline_parallel_size <= {max_pp} with data_parallel_size={dp}")
    if hw.platform == "cpu":
        options.append("simulate more devices per host: XLA_FLAGS=--xla_force_host_platform_device_count=<n>")
    if not options:
        return f"With tensor_parallel_size={tp} nothing that large fits; use more hosts"
    return f"With tensor_parallel_size={tp} fits: " + ", or ".join(options)
