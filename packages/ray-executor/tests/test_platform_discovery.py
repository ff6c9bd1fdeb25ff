"""The engine finds its platform through ``pipejax.platform_plugins`` entry points.

The last test installs a test-only plugin (tests/fixtures/fake-platform) next to pipejax-platform-tpu
in a fresh venv and checks that ``current_platform()`` picks it up: the mechanism is real, not an import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from pipejax.ray_executor import platforms

PACKAGES = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "fake-platform"


class FakeEntryPoint:
    def __init__(self, name, func):
        self.name, self.value, self._func = name, f"tests:{name}", func

    def load(self):
        return self._func


def _raise():
    raise RuntimeError("probe exploded")


@pytest.fixture
def plugins(monkeypatch):
    """Install fake entry points: ``plugins({"name": function})``."""
    platforms.reset_current_platform()

    def install(funcs):
        eps = [FakeEntryPoint(n, f) for n, f in funcs.items()]
        monkeypatch.setattr(platforms, "entry_points", lambda group: eps if group == "pipejax.platform_plugins" else [])

    monkeypatch.delenv("PIPEJAX_PLATFORM_PLUGIN", raising=False)
    yield install
    platforms.reset_current_platform()


def test_the_one_that_applies_is_imported_lazily_and_cached(plugins, tmp_path, monkeypatch):
    (tmp_path / "lazy_platform_mod.py").write_text("class P:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins({"off": lambda: None, "lazy": lambda: "lazy_platform_mod.P", "broken": _raise})
    answers = platforms.discover_platforms()
    assert [(a.name, a.applies) for a in answers] == [("broken", False), ("lazy", True), ("off", False)]
    assert "probe exploded" in answers[0].error
    assert "lazy_platform_mod" not in sys.modules  # discovery imports no platform class
    first = platforms.current_platform()
    assert type(first).__qualname__ == "P" and platforms.current_platform() is first


def test_several_apply_needs_a_choice(plugins, monkeypatch):
    plugins({"a": lambda: "collections.OrderedDict", "b": lambda: "collections.Counter"})
    monkeypatch.setenv("PIPEJAX_PLATFORM_PLUGIN", "b")  # read at the edge (engine_config), not here
    with pytest.raises(platforms.PlatformDiscoveryError) as err:
        platforms.current_platform()
    message = str(err.value)
    assert "several platforms apply" in message and "PIPEJAX_PLATFORM_PLUGIN=<name>, one of: a, b" in message
    assert "a -> collections.OrderedDict" in message
    assert type(platforms.current_platform("b")).__name__ == "Counter"
    assert platforms.current_platform() is platforms.current_platform("b")  # cached for the process
    with pytest.raises(platforms.PlatformDiscoveryError, match="already runs on plugin 'b'"):
        platforms.current_platform("a")


def test_errors_name_what_is_installed(plugins):
    plugins({"off": lambda: None, "odd": lambda: 42, "broken": _raise})
    with pytest.raises(platforms.PlatformDiscoveryError, match="no platform applies.*broken failed.*odd failed.*"
                       "not a class path.*off does not apply.*pipejax-platform-tpu"):
        platforms.current_platform()
    with pytest.raises(platforms.PlatformDiscoveryError, match="PIPEJAX_PLATFORM_PLUGIN='off', but no plugin"):
        platforms.current_platform("off")
    plugins({"missing": lambda: "no_such_module_xyz.Platform"})
    with pytest.raises(platforms.PlatformDiscoveryError, match="cannot import platform class 'no_such_module_xyz"):
        platforms.current_platform()


def _build_wheels(folders: list[Path], out: Path) -> list[Path]:
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation", "--no-index"]
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "-w", str(out)]
    subprocess.run([*cmd, *map(str, folders)], check=True, capture_output=True, timeout=300)
    return sorted(out.glob("*.whl"))


def _third_party_site(dest: Path) -> Path:
    """This interpreter's site-packages without any pipejax distribution (links, not copies)."""
    dest.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if "pipejax" in name or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


IN_VENV = """
import json
from importlib.metadata import entry_points
from pipejax.ray_executor import platforms

def which(choice):
    platforms.reset_current_platform()
    try:
        p = platforms.current_platform(choice)
        return f"{type(p).__module__}.{type(p).__qualname__}"
    except platforms.PlatformDiscoveryError as e:
        return f"error: {e}"

print(json.dumps({
    "entry_points": sorted(ep.name for ep in entry_points(group="pipejax.platform_plugins")),
    "fake": which("fake"), "tpu": which("tpu"), "unchosen": which(None),
}))
"""


@pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="needs pip to install wheels")
def test_engine_picks_up_an_installed_test_only_plugin(tmp_path):
    """~10 s: builds six wheels, installs them into a fresh venv, imports JAX there once."""
    folders = [PACKAGES / d for d in ("pp-utils", "runner", "worker", "platform-tpu", "ray-executor")] + [FIXTURE]
    wheels = _build_wheels(folders, tmp_path / "wheels")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*install, *map(str, wheels)], check=True, capture_output=True, timeout=300)
    # jax, numpy, tokenizers... come from this interpreter, every pipejax package from the wheels.
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "third_party.pth").write_text(str(_third_party_site(tmp_path / "third_party")) + "\n")
    env = {"PATH": os.environ.get("PATH", ""), "JAX_PLATFORMS": "cpu", "PIPEJAX_PLATFORM": "cpu"}
    out = subprocess.run([python, "-c", textwrap.dedent(IN_VENV)], check=True, capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    got = json.loads(out.stdout)
    assert got["entry_points"] == ["fake", "tpu"]
    assert got["fake"] == "pipejax_fake_platform.FakePlatform"
    assert got["tpu"] == "pipejax.platform_tpu.platform.TpuPlatform"
    assert got["unchosen"].startswith("error: several platforms apply")
    assert "fake -> pipejax_fake_platform.FakePlatform" in got["unchosen"]
