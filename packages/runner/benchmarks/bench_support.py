"""What the runner's benchmarks share with the benchmark report's sections: the summary of repeated figures
(median, min, max: the report's shape) and an object served from a fresh process of its own (``EngineProcess``).
The report's sections import this file by its path (benchmarks/pipejax_benchmarks/sections/common.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of ``values`` (all of them kept, for the record)."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "values": []}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v), "values": v}


# --- an engine in a process of its own ------------------------------------------------------------


def _serve(conn, factory: Callable[..., Any], args: tuple) -> None:
    """The child's loop: build ``factory(*args)``, then answer (method, args) calls until told to stop."""
    import traceback

    try:
        obj = factory(*args)
        conn.send((True, None))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send((False, traceback.format_exc()))
        return
    while (msg := conn.recv()) is not None:
        method, call_args = msg
        try:
            conn.send((True, getattr(obj, method)(*call_args)))
        except Exception:  # noqa: BLE001
            conn.send((False, traceback.format_exc()))
    if hasattr(obj, "close"):
        obj.close()
    conn.send((True, None))


class EngineProcess:
    """``factory(*args)`` (an engine side; its ``close()``, if it has one, runs at exit) in a fresh spawned
    process; ``call(method, *args)`` runs one of its methods there and returns the (picklable) result. Every
    wait has a timeout."""

    def __init__(self, factory: Callable[..., Any], *args, timeout_s: float = 1800.0):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.timeout_s = timeout_s
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self._proc.start()
        self._reply(f"building {factory.__name__}")

    def _reply(self, what: str) -> Any:
        if not self._conn.poll(self.timeout_s):
            self._proc.kill()
            raise TimeoutError(f"{what} took over {self.timeout_s:.0f} s in process {self._proc.pid}")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"{what} failed in process {self._proc.pid}:\n{value}")
        return value

    def call(self, method: str, *args) -> Any:
        self._conn.send((method, args))
        return self._reply(method)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._proc.is_alive():
                self._conn.send(None)
                self._reply("close")
        finally:
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
