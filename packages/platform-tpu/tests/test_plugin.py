"""Registration: cheap (no JAX), idempotent, and found through real entry points in a fresh venv."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipejax.platform_tpu import PLATFORM_CLASS, TpuPlatform, plugin
from pipejax.platform_tpu.plugin import VLLM_PLATFORM_CLASS

PACKAGES = Path(__file__).resolve().parents[2]


def test_register_returns_the_class_path_every_time():
    assert plugin.register() == plugin.register() == PLATFORM_CLASS
    module, _, name = PLATFORM_CLASS.rpartition(".")
    assert getattr(importlib.import_module(module), name) is TpuPlatform


def test_vllm_registration_applies_only_when_asked_or_tpus_are_seen(tmp_path, monkeypatch):
    roots = {"sys_root": str(tmp_path / "sys"), "dev_root": str(tmp_path / "dev")}
    assert not plugin.applies({}, **roots)
    assert plugin.applies({"PIPEJAX_PLATFORM": "cpu"}, **roots)
    assert not plugin.applies({"PIPEJAX_PLATFORM": "bogus"}, **roots)
    assert plugin.applies({"TPU_ACCELERATOR_TYPE": "v6e-8"}, **roots)
    (tmp_path / "dev2").mkdir()
    (tmp_path / "dev2" / "accel0").write_text("")
    assert plugin.applies({}, sys_root=roots["sys_root"], dev_root=str(tmp_path / "dev2"))
    monkeypatch.setenv("PIPEJAX_PLATFORM", "tpu")
    assert plugin.register_vllm() == plugin.register_vllm() == VLLM_PLATFORM_CLASS
    monkeypatch.setattr(plugin, "applies", lambda: False)
    assert plugin.register_vllm() is None


CHEAP = """
import sys
import pipejax.platform_tpu.plugin as plugin
first = (plugin.register(), plugin.register_vllm())
loaded = set(sys.modules)
assert (plugin.register(), plugin.register_vllm()) == first
assert set(sys.modules) == loaded, "a second call imported something"
import pipejax.platform_tpu
pipejax.platform_tpu.TpuPlatform()  # what a host framework does with the class path
heavy = ("jax", "jaxlib", "numpy", "pipejax.pp_utils", "pipejax.runner", "pipejax.worker")
heavy = [m for m in heavy if m in sys.modules]
assert not heavy, heavy
"""


def test_plugin_import_and_calls_are_cheap():
    env = {k: v for k, v in os.environ.items() if k != "PIPEJAX_PLATFORM"}
    subprocess.run([sys.executable, "-c", CHEAP], check=True, env=env, timeout=60)


def build_wheels(folders: list[Path], out: Path) -> list[Path]:
    """Wheels of local packages, built the way pip installs them (hatchling from here when present)."""
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation", "--no-index"]
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "-w", str(out)]
    subprocess.run([*cmd, *map(str, folders)], check=True, capture_output=True, timeout=300)
    return sorted(out.glob("*.whl"))


def make_venv(path: Path, wheels: list[Path]) -> Path:
    """A fresh venv (no pip, nothing third-party) holding exactly ``wheels``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*install, *map(str, wheels)], check=True, capture_output=True, timeout=300)
    return python


IN_VENV = """
import dataclasses, importlib, importlib.util, json, sys
from importlib.metadata import distributions, entry_points

assert importlib.util.find_spec("jax") is None and importlib.util.find_spec("pipejax.ray_executor") is None
(ep,) = entry_points(group="pipejax.platform_plugins")
(vllm_ep,) = entry_points(group="vllm.platform_plugins")
path = ep.load()()
module, _, name = path.rpartition(".")
platform = getattr(importlib.import_module(module), name)()

@dataclasses.dataclass(frozen=True)
class Config:  # ParallelConfig's fields (pipejax.pp_utils itself needs JAX, which this venv lacks)
    pipeline_parallel_size: int = 2
    tensor_parallel_size: int = 2
    data_parallel_size: int = 1
    pp_layer_partition: object = None
    distributed_executor_backend: object = None

plan = platform.plan(Config())
print(json.dumps({
    "dists": sorted(d.metadata["Name"] for d in distributions()),
    "entry_point": [ep.name, ep.value, path],
    "vllm": [vllm_ep.name, vllm_ep.value, vllm_ep.load()()],
    "backend": plan.backend,
    "stage_env": plan.stage(0, 1).env,
    "jax_loaded": "jax" in sys.modules,
}))
"""


@pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="needs pip to install wheels")
def test_entry_points_in_a_venv_holding_only_this_package(tmp_path):
    folders = [PACKAGES / d for d in ("pp-utils", "runner", "worker", "platform-tpu")]
    python = make_venv(tmp_path / "venv", build_wheels(folders, tmp_path / "wheels"))
    env = {"PATH": os.environ.get("PATH", ""), "PIPEJAX_PLATFORM": "cpu"}
    out = subprocess.run([python, "-c", textwrap.dedent(IN_VENV)], check=True, capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    got = json.loads(out.stdout)
    assert got["dists"] == ["pipejax-platform-tpu", "pipejax-pp-utils", "pipejax-runner", "pipejax-worker"]
    assert got["entry_point"] == ["tpu", "pipejax.platform_tpu.plugin:register", PLATFORM_CLASS]
    assert got["vllm"] == ["pipejax_tpu", "pipejax.platform_tpu.plugin:register_vllm", VLLM_PLATFORM_CLASS]
    assert got["backend"] == "uni"
    assert got["stage_env"] == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert got["jax_loaded"] is False
