"""How many XLA programs this process has built, and how many of them JAX's persistent compilation cache
supplied: counted from JAX's own monitoring events, for the start-up line of ``pipejax generate``."""

from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

# jax._src.dispatch.BACKEND_COMPILE_EVENT: one per program built, a cache read included
_BUILT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """Programs built so far in this process: ``programs`` in ``seconds`` (compiling or reading the cache), of
    which ``cache_hits`` came from the persistent cache."""

    programs: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        return self.programs - self.cache_hits

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(self.programs - other.programs, self.cache_hits - other.cache_hits,
                            self.seconds - other.seconds)

    def __add__(self, other: CompileStats) -> CompileStats:
        return CompileStats(self.programs + other.programs, self.cache_hits + other.cache_hits,
                            self.seconds + other.seconds)


_lock = threading.Lock()
_counts = {"programs": 0, "cache_hits": 0, "seconds": 0.0}
_listening = False


def _on_event(event: str, **_kwargs) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


def _on_duration(event: str, duration: float, **_kwargs) -> None:
    if event == _BUILT:
        with _lock:
            _counts["programs"] += 1
            _counts["seconds"] += duration


def current() -> CompileStats:
    """This process's counts since the first call (which starts listening: earlier programs are not counted)."""
    global _listening
    with _lock:
        if not _listening:
            monitoring.register_event_listener(_on_event)
            monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
        return CompileStats(**_counts)
