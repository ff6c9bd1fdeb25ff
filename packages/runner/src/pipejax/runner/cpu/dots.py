"""Which library XLA:CPU runs a few-row decode step's dots with: YNNPACK or XLA's own dot (Eigen).

jaxlib 0.10.2's XLA:CPU hands dots to YNNPACK fusions by default. On some CPUs YNNPACK runs a matmul of
a few rows against a weight matrix far below XLA's own dot: on a 2-CPU AMD EPYC (no AVX-512) the benchmark
model's decode step took 79 against 126 ms at 16 rows without YNNPACK (the profiler put its MLP dots of
16 x 768 x 2048 at 1.6 GB/s of weights), 74-86 against 109-117 ms at 8 rows and 122-152 against 169-175 at 32,
while 64 rows ran as fast or faster with it (2026-12-01, ``decode_bench.py`` with XLA_FLAGS alternated). So
the choice is measured, once per process (at the first few-row decode step), on the machine at hand: a pair
of MLP dots at 16 rows, compiled both ways and timed alternately. Decode steps of ``FEW_ROWS`` rows compile
without YNNPACK only where that pair runs clearly faster so; every other step keeps XLA's default.

Where JAX's persistent compilation cache is on, the choice is remembered in its folder (per CPU model, core
count and jaxlib): the cached step programs depend on it, and a second start that measured the other way
(the two are close on some machines) would compile the few-row steps again instead of reusing them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import statistics
import time

import jax
import jax.numpy as jnp
import jaxlib

from pipejax.runner.panels import swiglu
from pipejax.runner.step_inputs import StepShape

log = logging.getLogger(__name__)

CHOICES = ("ynnpack", "eigen")
FEW_ROWS = (4, 32)  # decode rows (padded) whose steps may compile without YNNPACK; 1 row is a matvec either way
WITHOUT_YNNPACK = {"xla_cpu_experimental_ynn_fusion_type": ""}  # a jax.jit compiler option of jaxlib 0.10.2
CLEAR_WIN = 0.8  # "eigen" only where its median time is below this fraction of YNNPACK's
_PROBE_ROWS, _PROBE_HIDDEN, _PROBE_MLP, _PROBE_ROUNDS = 16, 768, 2048, 7


def few_rows(shape: StepShape) -> bool:
    """Whether ``shape`` is a decode-only step of ``FEW_ROWS`` rows."""
    return not shape.prefill_rows and FEW_ROWS[0] <= shape.decode_rows <= FEW_ROWS[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def remembered_choice_path(folder: str) -> str:
    """The file in ``folder`` that holds this machine's choice: keyed by what the measurement depends on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = hashlib.sha256(f"{_cpu_model()}|{cores}|{jaxlib.__version__}".encode()).hexdigest()[:16]
    return os.path.join(folder, f"pipejax-few-row-dots-{key}")


@functools.cache
def choice(remember_in: str | None = None) -> str:
    """This machine's choice: read from ``remember_in`` (a folder) where an earlier process left it, else
    measured (``measured_choice``) and, with a folder, written there. Once per process."""
    path = remembered_choice_path(remember_in) if remember_in else None
    if path and os.path.exists(path):
        with open(path) as f:
            remembered = f.read().strip()
        if remembered in CHOICES:
            log.info("few-row decode dots: %s (remembered in %s)", remembered, path)
            return remembered
        log.warning("ignoring %s: %r is not one of %s", path, remembered, CHOICES)
    measured = measured_choice()
    if path:
        try:
            os.makedirs(remember_in, exist_ok=True)
            with open(f"{path}.{os.getpid()}", "w") as f:
                f.write(measured)
            os.replace(f"{path}.{os.getpid()}", path)  # atomic: concurrent stages never read half a file
        except OSError as e:
            log.warning("could not remember the few-row dots choice in %s: %s", path, e)
    return measured


@functools.cache
def measured_choice() -> str:
    """"eigen" where a gate/up pair of dots at 16 rows runs clearly faster on this CPU without YNNPACK, else
    "ynnpack". About 0.3 s, once per process (every CPU device of a process shares the same cores)."""
    device = jax.devices("cpu")[0]
    x = jax.device_put(jnp.full((_PROBE_ROWS, _PROBE_HIDDEN), 0.01, jnp.float32), device)
    gate, up = (jax.device_put(jnp.full((_PROBE_HIDDEN, _PROBE_MLP), v, jnp.float32), device) for v in (0.02, 0.03))

    def mlp_dots(x, gate, up):
        return swiglu(x @ gate, x @ up)

    variants = {"ynnpack": jax.jit(mlp_dots), "eigen": jax.jit(mlp_dots, compiler_options=WITHOUT_YNNPACK)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn(x, gate, up).block_until_ready()
    for _ in range(_PROBE_ROUNDS):  # alternated, so both see the same machine load
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(x, gate, up).block_until_ready()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    choice = "eigen" if median["eigen"] < CLEAR_WIN * median["ynnpack"] else "ynnpack"
    log.info("few-row decode dots: %s (16-row MLP dots: %.2f ms with YNNPACK, %.2f ms without)", choice,
             median["ynnpack"] * 1e3, median["eigen"] * 1e3)
    return choice
