"""The persistent compilation cache: a second process with the same model and buckets compiles
nothing new (every step program comes from the cache the first process filled).

The script caches every compile (threshold 0): with the worker's 0.2 s threshold, a tiny model's
program that compiles in ~0.2 s is skipped by one run and written by the next, so the file lists
would differ by timing alone (CI saw that on a loaded machine).

Where decode steps run their matmuls on XLA's dot, the two processes' few-row dots measurements (``cpu_dots``)
are made to disagree, as they did in CI on a loaded machine: the second start must take the choice the first
remembered in the cache folder, or it compiles its few-row decode steps again. With the CPU dense kernel (the
default here) there is no such choice to make."""

import os
import subprocess
import sys

import pytest
from worker_oracle import CACHE

pytestmark = pytest.mark.timeout(300)

SCRIPT = r"""
import sys
from pipejax.runner.config import StageConfig
from pipejax.runner.cpu import dots as cpu_dots
from pipejax.worker import StageWorker, WorkerConfig, worker as worker_module
worker_module.MIN_CACHED_COMPILE_S = 0.0
cpu_dots.measured_choice = lambda: sys.argv[3]  # what this process would measure
from pipejax.runner.cpu import select as select_module
# what the kernels' measurement would choose here, fixed: XLA's formulation or the CPU kernels
select_module.measured_choices = lambda cfg, n, limits, auto, remember: {k: {"choice": sys.argv[4]} for k in auto}
from worker_oracle import CACHE, LIMITS
worker = StageWorker(WorkerConfig(sys.argv[1], StageConfig(0, 1), tp_size=1, cache=CACHE, scheduler=LIMITS,
                                  compilation_cache_dir=sys.argv[2]))
worker.load(CACHE.num_blocks)
worker.warmup(worker.warmup_batches(max_shapes=3), progress=False)
"""


def run_stage_process(model, cache_dir, measured, dense):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(__file__)}
    command = [sys.executable, "-c", SCRIPT, str(model), str(cache_dir), measured, dense]
    subprocess.run(command, env=env, check=True, timeout=240)
    return sorted(os.listdir(cache_dir))


@pytest.mark.parametrize("dense", ["xla", "cpu-kernel"])
def test_second_start_reuses_the_compiled_steps(checkpoint, tmp_path, dense):
    assert CACHE.num_blocks
    first = run_stage_process(checkpoint[0], tmp_path, "eigen", dense)
    assert any("step" in name or "forward" in name for name in first), first  # the stage's jitted step is cached
    assert any(name.startswith("pipejax-few-row-dots-") for name in first) == (dense == "xla"), first
    assert run_stage_process(checkpoint[0], tmp_path, "ynnpack", dense) == first


def test_the_cache_folder_comes_from_the_callers_environment(monkeypatch):
    """The worker reads no environment: the edges map theirs (set: that folder; empty: no cache)."""
    from pipejax.runner.config import StageConfig
    from pipejax.worker.worker import WorkerConfig, compilation_cache_dir_from_env, default_compilation_cache_dir

    default = default_compilation_cache_dir()
    assert default.endswith(os.path.join(".cache", "pipejax", "jax-compilation"))
    assert compilation_cache_dir_from_env({}) == default
    assert compilation_cache_dir_from_env({"PIPEJAX_COMPILATION_CACHE_DIR": "/x"}) == "/x"
    assert compilation_cache_dir_from_env({"PIPEJAX_COMPILATION_CACHE_DIR": ""}) is None
    monkeypatch.setenv("PIPEJAX_COMPILATION_CACHE_DIR", "/elsewhere")
    assert WorkerConfig("m", StageConfig(0, 1), tp_size=1).compilation_cache_dir == default
