"""Which of the CPU backend's kernels a stage runs: ``select(mesh, model_config, options, limits)``.

Each kernel (the dense matmuls over weights in panels, the decode rows' attention, the prefill rows' attention)
replaces part of ``model.py``'s XLA formulation. Whether it is faster depends on the CPU: on an AVX-512 EPYC the
kernels won at every measured shape, on an AVX2 one the dense kernel lost to XLA's dot at 64 rows (until its tile
was reshaped for AVX2's 16 registers and its rows packed). So "auto" measures, on the host at hand, each kernel
against XLA's formulation of the same operation at the stage's own shapes (``probe``) and runs a kernel only where
it was faster; "xla" or "cpu-kernel" force a choice. A dense kernel faster at the decode rows but not at a prefill's
runs the decode rows only, XLA's dot over its panels the larger calls (``xla_rows_choice``). Where the CPU has AMX,
the dense probe also times the kernel on AMX's bf16 tiles, splitting the weight at each call and reading its tiles
split once and kept (1.5x the weights' bytes more), which then run from the rows they won at (``amx_choice``;
``KernelOptions.dense_tiles`` forces a choice). A verdict is remembered per host signature (CPU model and ISA flags,
cores, versions, the XLA and numba target settings), shapes and a digest of this package's source: in the process,
and in a JSON file next to JAX's compilation cache where that is on, so a restart measures nothing (and compiles the
same step programs).

A kernel numba has not compiled on this host yet takes ~5-12 s of one core to build (``build``). How a stage
waits for that is ``KernelOptions.build``: "wait" (a ``StageRunner``'s default) builds them before the first
step; "background" (the serving engines' default) runs XLA's formulation now and has a child process build the
kernels at a lower priority, for the runner to measure and switch to between two steps
(``StageRunner.adopt_built_kernels``); "cached" runs only kernels already built (a one-shot
``pipejax generate``: a few prompts gain less from the kernels than their build costs). The kernel of weights kept
quantized (``QUANTIZED_KERNEL``) is built the same way; it is not measured: XLA's alternative dequantizes every
layer's weight at every step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os

import jax
import jax.numpy as jnp

from pipejax.runner.config import ModelConfig, SchedulerConfig
from pipejax.runner.cpu import dots, probe
from pipejax.runner.model import Kernels
from pipejax.runner.panels import PANEL

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "xla", "cpu-kernel")
# The dense kernel's tiles: "vector" (FMAs on vector registers), "amx" (AMX's bf16 tiles at fp32 accuracy, where the
# CPU has them, ``amx_kernel``, the weight split into them at each call), "amx-kept" (the same over each weight's
# tiles split once at load and kept beside its panels: 6 more bytes a weight), "auto" (AMX where the CPU has it
# and it measured faster, each way from the rows it won at).
DENSE_TILES = ("auto", "vector", "amx", "amx-kept")
# /proc/cpuinfo flags a verdict depends on (vector width, FMA, the matrix units)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")
KERNEL_NAMES = ("dense_matmuls", "decode_attention", "prefill_attention")
# The kernel of weights kept quantized in panels: no choice to measure (XLA's alternative dequantizes every layer's
# weight each step), but built like the others, so a stage that will not wait for numba runs XLA's meanwhile.
QUANTIZED_KERNEL = "quantized_dense"
KERNEL_BUILDS = ("background", "wait", "cached")
KERNEL_BUILD_ENV = "PIPEJAX_CPU_KERNEL_BUILD"  # read at the edges (engine_args), passed down as KernelOptions.build
DENSE_TILES_ENV = "PIPEJAX_CPU_DENSE_TILES"  # read at the edges, passed down as KernelOptions.dense_tiles
# A kernel runs where its least time is below XLA's at the decode rows, and at the prefill rows below XLA's times
# this (the two medians' own spread on an idle 2-core host: ~5%).
PREFILL_TOLERANCE = 1.05
# part of a remembered verdict's key (with a digest of this package's source): raised when the probes measure more
# (3: AMX's kept tiles; 4: XLA's dot over the panels; 5: each candidate's least time, not its median)
PROBES_VERSION = 5


def _choice_from_env(environ, name: str, default: str, choices: tuple[str, ...]) -> str:
    """``$name`` in ``environ`` (unset or empty: ``default``), checked against ``choices``: for the edges that read
    the environment (the engine's arguments, the vLLM platform)."""
    value = environ.get(name) or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}; use one of {', '.join(choices)}")
    return value


def cpu_dense_tiles_from_env(environ) -> str:
    """``$PIPEJAX_CPU_DENSE_TILES`` (unset: "auto"), checked."""
    return _choice_from_env(environ, DENSE_TILES_ENV, "auto", DENSE_TILES)


def cpu_kernel_build_from_env(environ, default: str = "background") -> str:
    """``$PIPEJAX_CPU_KERNEL_BUILD`` (unset: ``default``), checked."""
    return _choice_from_env(environ, KERNEL_BUILD_ENV, default, KERNEL_BUILDS)


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """What a caller asks of the CPU backend: "auto" (measured), "xla" or "cpu-kernel" per kernel; how decode
    steps run the layers ("auto", "scan", "unrolled"); XLA's library for few-row dots ("auto", "ynnpack",
    "eigen"); how an "auto" kernel numba has not built yet is waited for (``KERNEL_BUILDS``, the module's
    note); and the dense kernel's tiles (``DENSE_TILES``). An explicit "cpu-kernel" is always built before the
    first step."""

    dense_matmuls: str = "auto"
    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    decode_layers: str = "auto"
    few_row_dots: str = "auto"
    build: str = "wait"
    dense_tiles: str = "auto"

    def __post_init__(self):
        for name in ("dense_matmuls", "decode_attention", "prefill_attention"):
            if getattr(self, name) not in KERNEL_CHOICES:
                raise ValueError(f"{name}={getattr(self, name)!r}; use 'auto', 'xla' or 'cpu-kernel'")
        if self.decode_layers not in ("auto", "scan", "unrolled"):
            raise ValueError(f"decode_layers={self.decode_layers!r}; use 'auto', 'scan' or 'unrolled'")
        if self.few_row_dots not in ("auto", *dots.CHOICES):
            raise ValueError(f"few_row_dots={self.few_row_dots!r}; use 'auto', 'ynnpack' or 'eigen'")
        if self.dense_tiles not in DENSE_TILES:
            raise ValueError(f"dense_tiles={self.dense_tiles!r}; use 'auto', 'vector', 'amx' or 'amx-kept'")
        if self.build not in KERNEL_BUILDS:
            raise ValueError(f"CPU kernel build={self.build!r}; use 'background', 'wait' or 'cached' "
                             f"(--cpu-kernel-build / {KERNEL_BUILD_ENV})")


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a stage runs: "cpu-kernel" or "xla" per kernel, "unrolled" or "scan" decode layers, the few-row dots'
    library (None off CPU; "auto": measured at the first such step, ``dots``), the measurements behind it, the
    kernels still to build (``pending``: running XLA's formulation until then), and from how many rows the dense
    kernel runs on AMX's tiles, splitting the weight (None: never) and over its kept tiles (below the first;
    None: no tiles kept)."""

    dense_matmuls: str
    decode_attention: str
    prefill_attention: str
    decode_layers: str
    few_row_dots: str | None
    measured: dict = dataclasses.field(default_factory=dict, compare=False)
    pending: tuple[str, ...] = ()
    quantized_kernel: bool = True  # weights kept quantized in panels run the quantized kernel (False: not built yet)
    dense_amx_rows: int | None = None  # the dense kernel's calls of this many rows or more run on AMX's tiles
    dense_kept_rows: int | None = None  # from this many rows (below dense_amx_rows) on the weights' kept tiles
    dense_xla_rows: int | None = None  # the dense calls of this many rows or more run XLA's dot over the panels

    @property
    def keeps_tiles(self) -> bool:
        """Whether the stage keeps its dense weights' AMX tiles beside their panels (``dense.keep_tiles``)."""
        return self.panels and self.dense_kept_rows is not None

    @property
    def panels(self) -> bool:
        """Whether the stage stores its dense weights in panels (the dense kernel's layout)."""
        return self.dense_matmuls == "cpu-kernel"

    def kernels(self, mesh) -> Kernels:
        """The substitutes ``model.stage_forward`` takes for this selection on ``mesh``."""
        from pipejax.runner.cpu import decode_attention, dense, prefill_attention, quantized_dense

        dense_kernel = (dense.for_mesh(mesh, self.dense_amx_rows, self.dense_kept_rows, self.dense_xla_rows)
                        if self.dense_matmuls == "cpu-kernel" else None)
        return Kernels(
            dense=dense_kernel,
            # a MoE's experts are in panels where the dense weights are: the same kernel reads each one's routed rows
            routed_experts=dense.routed_experts if dense_kernel is not None and dense.prepare() else None,
            # weights kept quantized are in panels on one CPU device whatever the float choice (``use_panels``)
            quantized_dense=quantized_dense.matmul if mesh.devices.size == 1 and self.quantized_kernel else None,
            decode_attention=decode_attention.for_mesh(mesh) if self.decode_attention == "cpu-kernel" else None,
            prefill_attention=prefill_attention.for_mesh(mesh) if self.prefill_attention == "cpu-kernel" else None,
        )


def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


def fitting(devices: list[jax.Device], cfg: ModelConfig, native: bool) -> dict[str, bool]:
    """Which kernels can run on a stage of ``cfg`` on ``devices``: CPU devices, float32, numba installed, the
    native model implementation; the dense kernel on one device (with tp > 1 XLA's sharded dots keep the
    weights' own layout), the prefill kernel for a head dim of whole panels."""
    base = (native and numba_available() and all(d.platform == "cpu" for d in devices)
            and jnp.dtype(cfg.dtype) == jnp.float32)
    return {"dense_matmuls": base and len(devices) == 1, "decode_attention": base,
            "prefill_attention": base and cfg.head_dim % PANEL == 0}


NEEDS = {
    "dense_matmuls": "the native model implementation, one CPU device per stage (tp = 1), float32 and numba",
    "decode_attention": "the native model implementation, CPU devices, float32 and numba",
    "prefill_attention": "the native model implementation, CPU devices, float32, a head dim divisible by 32 "
                         "and numba",
}


def select(mesh, cfg: ModelConfig, options: KernelOptions, limits: SchedulerConfig, native: bool = True,
           remember_in: str | None = None) -> Selection:
    """The kernels a stage of ``cfg`` on ``mesh`` runs for ``options`` (``limits``: its batching limits, resolved
    against the model). "auto" measures where a kernel can run (``measured_choices``); asking for
    "cpu-kernel" where it cannot run is an error that says what it needs and what is here."""
    devices = list(mesh.devices.flat)
    fits = fitting(devices, cfg, native)
    for name, ok in fits.items():
        if getattr(options, name) == "cpu-kernel" and not ok:
            here = (f"{len(devices)} {devices[0].platform} device(s), {cfg.dtype}, head dim {cfg.head_dim}, "
                    f"{'the native' if native else 'a non-native'} model implementation, numba "
                    f"{'installed' if numba_available() else 'missing'}")
            raise ValueError(f"{name}='cpu-kernel' needs {NEEDS[name]} (here: {here}); use 'auto'")
    auto = tuple(name for name, ok in fits.items() if ok and getattr(options, name) == "auto")
    unbuilt = ()
    # weights kept quantized on one CPU device: the quantized kernel, built at the first step unless the stage will
    # not wait for numba (then XLA's formulation runs until it is built; "cached" builds nothing)
    quantized_unbuilt = (cfg.quantization is not None and native and numba_available() and len(devices) == 1
                         and devices[0].platform == "cpu" and options.build != "wait" and not built(QUANTIZED_KERNEL))
    if quantized_unbuilt:
        log.info("the CPU quantized-weights kernel is not built on this host yet: XLA dequantizes the weights %s",
                 "while it builds in the background" if options.build == "background" else
                 f"(build {options.build!r}: it is built where a stage waits for it, or in the background)")
    if auto and options.build != "wait":
        known = known_choices(cfg, len(devices), limits, remember_in)
        unbuilt = tuple(n for n in auto if known.get(n, {}).get("choice") != "xla" and not built(n))
        if unbuilt:
            log.info("CPU kernels %s: not built on this host yet; XLA's formulation runs %s", ", ".join(unbuilt),
                     "while they build in the background" if options.build == "background" else
                     f"(build {options.build!r}: they are built where a stage waits for them, or in the background)")
        auto = tuple(n for n in auto if n not in unbuilt)
    measured = measured_choices(cfg, len(devices), limits, auto, remember_in) if auto else {}
    chosen = {name: ("cpu-kernel" if getattr(options, name) == "cpu-kernel" else
                     measured[name]["choice"] if name in measured else "xla") for name in fits}
    amx_rows, kept_rows = _dense_amx_rows(chosen["dense_matmuls"] == "cpu-kernel", options, cfg, len(devices),
                                          limits, measured, remember_in)
    xla_rows = (xla_rows_choice(measured["dense_matmuls"], limits.max_num_seqs)
                if "dense_matmuls" in measured and (amx_rows, kept_rows) == (None, None) else None)
    on_cpu = all(d.platform == "cpu" for d in devices)
    if options.decode_layers == "unrolled" and not (native and on_cpu):
        raise ValueError(f"decode_layers='unrolled' needs the native model implementation on CPU devices (here: "
                         f"{'native' if native else 'non-native'} on {devices[0].platform}); use 'auto'")
    if options.few_row_dots != "auto" and not on_cpu:
        raise ValueError(f"few_row_dots={options.few_row_dots!r} is an XLA:CPU choice; these are "
                         f"{devices[0].platform} devices: use 'auto'")
    return Selection(
        **chosen,
        decode_layers="unrolled" if options.decode_layers != "scan" and native and on_cpu else "scan",
        few_row_dots=options.few_row_dots if on_cpu else None,
        measured=measured,
        pending=(unbuilt + (QUANTIZED_KERNEL,) * quantized_unbuilt) if options.build == "background" else (),
        quantized_kernel=not quantized_unbuilt,
        dense_amx_rows=amx_rows,
        dense_kept_rows=kept_rows,
        dense_xla_rows=xla_rows,
    )


def _dense_amx_rows(dense_kernel: bool, options: KernelOptions, cfg: ModelConfig, tp: int, limits: SchedulerConfig,
                    measured: dict, remember_in: str | None) -> tuple[int | None, int | None]:
    """From how many rows the dense kernel runs on AMX's tiles, splitting the weight and over its kept tiles
    (``Selection.dense_amx_rows``, ``dense_kept_rows``): every call where asked "amx" or "amx-kept"; with "auto",
    where the CPU has AMX, as the dense probe measured (``amx_choice``); else never."""
    from pipejax.runner.cpu import dense

    if not dense_kernel or options.dense_tiles == "vector":
        return None, None
    if options.dense_tiles in ("amx", "amx-kept"):
        if not dense.amx_ready():
            raise ValueError(f"dense_tiles={options.dense_tiles!r} needs a CPU with AMX's bf16 tiles (amx_tile and "
                             "amx_bf16 in /proc/cpuinfo) and a Linux that grants them; use 'auto' or 'vector'")
        return (1, None) if options.dense_tiles == "amx" else (None, 1)
    if not dense.amx_ready():
        return None, None
    if "dense_matmuls" not in measured:  # the kernel was forced: its probe still decides the tiles
        measured = measured_choices(cfg, tp, limits, ("dense_matmuls",), remember_in)
    return amx_choice(measured["dense_matmuls"], limits.max_num_seqs, probe_shapes(cfg, tp, limits)["prefill_tokens"])


def amx_choice(figures: dict, decode_rows: int, prefill_rows: int) -> tuple[int | None, int | None]:
    """The dense probe's verdict on AMX's tiles: (from how many rows the weight is split into them at each call,
    from how many its kept tiles run; None: never). Kept tiles where they beat the FMA tiles at the decode rows:
    from there, up to the prefill rows if splitting measured faster there (an Intel Xeon: kept faster than the FMA
    tiles and than splitting at 32-256 rows, 5 % slower than splitting at 2048). Else splitting from the
    decode rows where it was faster there; else from the rows above them where it was faster at the prefill rows (at
    the rows between, an Intel Xeon measured it even at twice the decode rows and faster from four times); else
    neither."""
    prefill, decode = figures.get("prefill", {}), figures.get("decode", {})
    if "amx_kept" in decode and decode["amx_kept"] < decode["kernel"]:
        split_wins = prefill.get("amx", float("inf")) < min(prefill.get("amx_kept", float("inf")), prefill["kernel"])
        return (prefill_rows if split_wins else None), decode_rows
    if "amx" not in prefill or prefill["amx"] >= prefill["kernel"]:
        return None, None
    return (decode_rows if decode.get("amx", float("inf")) < decode["kernel"] else decode_rows + 1), None


def _wrappers() -> dict:
    """Each kernel's JAX side (its ``KERNEL``: the numba module; ``prepare()``: build or load it)."""
    from pipejax.runner.cpu import decode_attention, dense, prefill_attention, quantized_dense

    return {"dense_matmuls": dense, "decode_attention": decode_attention, "prefill_attention": prefill_attention,
            QUANTIZED_KERNEL: quantized_dense}


def built(name: str) -> bool:
    """Whether numba's cache holds kernel ``name`` (then it loads in well under a second)."""
    from pipejax.runner.cpu import build

    return build.cached(_wrappers()[name].KERNEL)


def build_in_background(selection: Selection):
    """A ``build.BackgroundBuild`` of ``selection.pending``'s kernels (None: nothing pending)."""
    from pipejax.runner.cpu import build

    if not selection.pending:
        return None
    return build.BackgroundBuild([_wrappers()[n].KERNEL for n in selection.pending])


# --- measuring and remembering ---------------------------------------------------------------------------------


def host_signature(cpuinfo: str | None = None) -> dict[str, str]:
    """What a measured verdict depends on besides the shapes: the CPU (model, ISA flags, usable cores), the
    versions of what compiles the candidates, and the settings that retarget them (XLA_FLAGS' ISA cap, numba's
    target CPU). ``cpuinfo``: /proc/cpuinfo's text (default: read it)."""
    import jaxlib

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    try:
        numba_version = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba_version = "none"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": model,
        "isa": ",".join(f for f in ISA_FLAGS if f in flags),
        "cores": str(cores),
        "jaxlib": jaxlib.__version__,
        "numba": numba_version,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "numba_cpu": f"{os.environ.get('NUMBA_CPU_NAME', '')}/{os.environ.get('NUMBA_CPU_FEATURES', '')}",
    }


def probe_shapes(cfg: ModelConfig, tp: int, limits: SchedulerConfig) -> dict[str, int]:
    """The shapes the probes time for a stage: its model dims, tp, most decode rows, largest prefill step."""
    return {
        "hidden": cfg.hidden_size, "mlp": cfg.intermediate_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "tp": tp, "decode_rows": limits.max_num_seqs,
        "prefill_tokens": min(limits.max_num_batched_tokens, limits.max_model_len or limits.max_num_batched_tokens),
        "context": min(probe.DECODE_CONTEXT, limits.max_model_len or probe.DECODE_CONTEXT),
    }


def verdict_key(signature: dict[str, str], shapes: dict[str, int]) -> str:
    text = json.dumps({"host": signature, "shapes": shapes, "probes": PROBES_VERSION, "code": _kernels_source()},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@functools.cache
def _kernels_source() -> str:
    """A digest of the CPU backend's source (its kernels and probes): a verdict measured on other code is not
    reused (an editable install or an upgrade keeps the same versions)."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def measured_choices(cfg: ModelConfig, tp: int, limits: SchedulerConfig, names: tuple[str, ...],
                     remember_in: str | None = None) -> dict[str, dict]:
    """Per kernel of ``names``: {"choice": "cpu-kernel" | "xla", and the probes' least times in ms}, remembered
    (in the process; with ``remember_in``, in a file there) or measured now."""
    shapes = probe_shapes(cfg, tp, limits)
    key, path = _verdicts_at(shapes, remember_in)
    known = known_choices(cfg, tp, limits, remember_in)
    missing = tuple(n for n in names if n not in known)
    if missing:
        found = measure(shapes, missing)
        known.update(found)
        _in_process.setdefault(key, {}).update(found)
        if path:
            _remember(path, known)
    out = {n: known[n] for n in names}
    log.info("CPU kernels (%s): %s", "remembered" if not missing else "measured here",
             "; ".join(f"{n} {v['choice']} ({_figures(v)})" for n, v in out.items()))
    return out


def known_choices(cfg: ModelConfig, tp: int, limits: SchedulerConfig, remember_in: str | None = None
                  ) -> dict[str, dict]:
    """The verdicts remembered for a stage of these shapes on this host (in the process, or in ``remember_in``)."""
    key, path = _verdicts_at(probe_shapes(cfg, tp, limits), remember_in)
    known = dict(_remembered(path)) if path else {}
    known.update(_in_process.get(key, {}))
    return known


def _verdicts_at(shapes: dict[str, int], remember_in: str | None) -> tuple[str, str | None]:
    key = verdict_key(host_signature(), shapes)
    return key, os.path.join(remember_in, f"pipejax-cpu-kernels-{key}.json") if remember_in else None


_in_process: dict[str, dict[str, dict]] = {}


def _figures(v: dict) -> str:
    amx = {"xla_panels": "xla over the panels", "amx": "on AMX's tiles", "amx_kept": "kept"}
    return ", ".join(f"{k} {v[k]['kernel']:.2f} vs xla {v[k]['xla']:.2f}"
                     + "".join(f"; {what} {v[k][name]:.2f}" for name, what in amx.items() if name in v[k])
                     + " ms" for k in v if k != "choice")


def _cfg_for(shapes: dict[str, int]) -> ModelConfig:
    return ModelConfig(architecture="probe", vocab_size=PANEL, hidden_size=shapes["hidden"],
                       intermediate_size=shapes["mlp"], num_layers=1, num_heads=shapes["heads"],
                       num_kv_heads=shapes["kv_heads"], head_dim=shapes["head_dim"], rms_norm_eps=1e-6,
                       max_position_embeddings=shapes["context"], dtype="float32")


def measure(shapes: dict[str, int], names: tuple[str, ...]) -> dict[str, dict]:
    """Time each kernel of ``names`` against XLA's formulation (``probe``) at ``shapes``; the verdicts."""
    cfg, tp, device = _cfg_for(shapes), shapes["tp"], jax.devices("cpu")[0]
    rows, tokens = shapes["decode_rows"], shapes["prefill_tokens"]
    build_all(names)
    out = {}
    for name in names:
        if name == "dense_matmuls":
            figures = {"decode": probe.dense(cfg, rows, device, xla_panels=False),
                       "prefill": probe.dense(cfg, tokens, device)}
        elif name == "decode_attention":
            figures = {"decode": probe.decode_attention_ms(cfg, tp, rows, shapes["context"], device)}
        else:
            figures = {"prefill": probe.prefill_attention_ms(cfg, tp, tokens, device)}
        out[name] = {"choice": verdict(figures), **figures}
    return out


def build_all(names: tuple[str, ...]) -> None:
    """Build (or load from numba's cache) the kernels of ``names`` before any probe is timed: those not in the
    cache compile at once, the first here and the others in child processes (``build.fill_cache_alongside``),
    so a fresh install waits for its slowest kernel rather than for their sum."""
    from pipejax.runner.cpu import build

    wrapper = _wrappers()
    cold = [n for n in names if not built(n)]
    children = build.fill_cache_alongside([wrapper[n].KERNEL for n in cold[1:]])
    try:
        if cold:
            wrapper[cold[0]].prepare()
    finally:
        build.wait(children)
    for name in names:
        wrapper[name].prepare()


def verdict(figures: dict[str, dict[str, float]]) -> str:
    """"cpu-kernel" where the kernel was faster at the decode rows and, at the prefill rows, within
    ``PREFILL_TOLERANCE`` of XLA's formulation (the prefill share of a step is compute either way), or XLA's dot
    over its panels was (``xla_rows_choice``: the dense kernel, then, runs the decode rows only); else "xla"."""
    limit = {"decode": 1.0, "prefill": PREFILL_TOLERANCE}
    faster = all(min(f["kernel"], f.get("xla_panels", f["kernel"]) if phase == "prefill" else f["kernel"])
                 < limit[phase] * f["xla"] for phase, f in figures.items())
    return "cpu-kernel" if faster else "xla"


def xla_rows_choice(figures: dict, decode_rows: int) -> int | None:
    """From how many rows a stage in panels runs XLA's dot over them rather than the dense kernel (None: never):
    above the decode rows where the kernel won there (``verdict``) and XLA's dot over the panels beat it at the
    prefill rows by more than ``PREFILL_TOLERANCE``."""
    prefill = figures.get("prefill", {})
    if figures.get("choice") != "cpu-kernel" or "xla_panels" not in prefill:
        return None
    return decode_rows + 1 if prefill["kernel"] > PREFILL_TOLERANCE * prefill["xla_panels"] else None


def _remembered(path: str) -> dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return {}
    return {n: v for n, v in data.items() if isinstance(v, dict) and v.get("choice") in ("xla", "cpu-kernel")}


def _remember(path: str, verdicts: dict[str, dict]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(verdicts, f, indent=1)
        os.replace(f"{path}.{os.getpid()}", path)  # atomic: stages measuring at once never read half a file
    except OSError as e:
        log.warning("could not remember the CPU kernels' verdicts in %s: %s", path, e)

