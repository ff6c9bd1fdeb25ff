"""Which platform the engine runs on, found through entry points (never by importing one directly).

Every installed distribution may register a function in the ``pipejax.platform_plugins`` group; it
returns a platform class path (``"pkg.module.Class"``) where it applies, or None. ``current_platform(plugin)``
calls them all, picks the one that applies (of several, the one named ``plugin``: ``EngineConfig.platform_plugin``,
which the edge fills from ``PIPEJAX_PLATFORM_PLUGIN``), imports that class only then, and caches its instance for
the process. This module reads no environment variable.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger(__name__)

PLATFORM_PLUGINS_GROUP = "pipejax.platform_plugins"
PLATFORM_PLUGIN_ENV = "PIPEJAX_PLATFORM_PLUGIN"  # read at the edge (engine_args), named in messages here

_lock = threading.Lock()
_current: Any = None
_current_plugin: str | None = None  # the entry point ``_current`` came from


class PlatformDiscoveryError(RuntimeError):
    """No platform, or several and no choice, or a chosen one that is missing or broken."""


@dataclasses.dataclass(frozen=True)
class PluginAnswer:
    """What one plugin said: its entry point, the class path it returned, or why it failed."""

    name: str
    value: str  # "module:function" of the entry point
    class_path: str | None = None
    error: str | None = None

    @property
    def applies(self) -> bool:
        return self.class_path is not None


def discover_platforms() -> list[PluginAnswer]:
    """Load and call every ``pipejax.platform_plugins`` entry point (a failing one is recorded, not raised)."""
    answers = []
    for ep in sorted(entry_points(group=PLATFORM_PLUGINS_GROUP), key=lambda e: e.name):
        try:
            path = ep.load()()
        except Exception as e:  # a broken plugin must not hide the others
            log.warning("platform plugin %s (%s) failed: %r", ep.name, ep.value, e)
            answers.append(PluginAnswer(ep.name, ep.value, error=repr(e)))
            continue
        if path is not None and not isinstance(path, str):
            answers.append(PluginAnswer(ep.name, ep.value, error=f"returned {path!r}, not a class path or None"))
            continue
        answers.append(PluginAnswer(ep.name, ep.value, class_path=path))
    return answers


def select_platform(answers: list[PluginAnswer], choice: str | None) -> PluginAnswer:
    """The answer to use: ``choice`` by name if given, else the only one that applies."""
    listing = "; ".join(_describe(a) for a in answers) or "none installed"
    if choice:
        named = [a for a in answers if a.name == choice]
        if not named or not named[0].applies:
            raise PlatformDiscoveryError(
                f"{PLATFORM_PLUGIN_ENV}={choice!r}, but no plugin of that name applies "
                f"(group {PLATFORM_PLUGINS_GROUP!r}: {listing})"
            )
        return named[0]
    applying = [a for a in answers if a.applies]
    if not applying:
        raise PlatformDiscoveryError(
            f"no platform applies (group {PLATFORM_PLUGINS_GROUP!r}: {listing}); install one, "
            f"e.g. pipejax-platform-tpu, which also covers CPU development"
        )
    if len(applying) > 1:
        names = ", ".join(a.name for a in applying)
        raise PlatformDiscoveryError(
            f"several platforms apply ({listing}); choose one with {PLATFORM_PLUGIN_ENV}=<name>, one of: {names}"
        )
    return applying[0]


def resolve_class(class_path: str) -> type:
    """Import ``"pkg.module.Class"`` (or ``"pkg.module:Class"``)."""
    module, sep, name = class_path.rpartition(":") if ":" in class_path else class_path.rpartition(".")
    if not sep or not module:
        raise PlatformDiscoveryError(f"platform class path {class_path!r} is not 'package.module.Class'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise PlatformDiscoveryError(f"cannot import platform class {class_path!r}: {e!r}") from e


def current_platform(plugin: str | None = None) -> Any:
    """The platform instance this process runs on: discovered on first call (``plugin``, the name of an entry
    point, chooses when several apply), then cached. A process runs on one platform: naming another plugin
    than the cached one's is an error."""
    global _current, _current_plugin
    with _lock:
        if _current is None:
            answer = select_platform(discover_platforms(), plugin)
            _current, _current_plugin = resolve_class(answer.class_path)(), answer.name
            log.info("platform %s from plugin %s (%s)", answer.class_path, answer.name, answer.value)
        elif plugin and plugin != _current_plugin:
            raise PlatformDiscoveryError(
                f"{PLATFORM_PLUGIN_ENV}={plugin!r}, but this process already runs on plugin {_current_plugin!r}'s "
                f"platform; one process runs on one platform: name the same plugin, or start a new process"
            )
        return _current


def reset_current_platform() -> None:
    """Forget the cached platform (tests; a process that changed its environment)."""
    global _current, _current_plugin
    with _lock:
        _current, _current_plugin = None, None


def _describe(answer: PluginAnswer) -> str:
    if answer.error:
        return f"{answer.name} failed: {answer.error}"
    return f"{answer.name} -> {answer.class_path}" if answer.applies else f"{answer.name} does not apply"
