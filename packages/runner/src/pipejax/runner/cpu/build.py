"""Building a CPU kernel's XLA FFI handler and registering it with XLA, for ``cpu_decode_attention`` and
``cpu_dense`` (numba is imported only inside ``build``: the kernel modules load it on first use).

numba compiles a kernel on one thread, under a process-wide lock, into its on-disk cache (~5-10 s per kernel on
a 2-core EPYC; a cache hit loads in well under a second). So a fresh install's first start, which needs several
kernels, fills the cache of all but one in child processes while this process builds the first
(``fill_cache_alongside``), and every build holds a per-kernel file lock: stages starting at once on a host
compile each kernel once, the others load it from the cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 600.0  # longer than any kernel's compile; past it the build goes ahead unlocked


def build_and_register(target: str, kernel_module: str, what: str, instead: str) -> Any:
    """``kernel_module``'s ``compile_handler(parallel=True)`` (numba's threads on TBB; where TBB cannot be loaded,
    on the calling thread, with a warning), registered as the CPU FFI target ``target``; None, with a warning
    naming ``what`` and what runs ``instead``, where numba cannot build it. Keep the handler alive as long as XLA
    may call it."""
    try:
        with _compiling(kernel_module):
            handler = compile_handler(kernel_module, what)
    except Exception as e:  # noqa: BLE001 - a numba/LLVM that cannot build it: XLA's own formulation stays
        log.warning("the CPU %s kernel could not be built (%s: %s); using %s", what, type(e).__name__, e, instead)
        return None
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    jax.ffi.register_ffi_target(target, new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None), "cpu")
    return handler


def compile_handler(kernel_module: str, what: str) -> Any:
    """The module's handler over numba's threads; on one thread (with a warning) where TBB cannot be loaded."""
    compile_ = importlib.import_module(kernel_module).compile_handler
    try:
        return compile_(parallel=True)
    except Exception as e:  # noqa: BLE001 - no usable TBB: the kernel still runs, on one thread
        log.warning("the CPU %s kernel runs on one thread: its parallel build failed (%s: %s)",
                    what, type(e).__name__, e)
        return compile_(parallel=False)


def cached(kernel_module: str) -> bool:
    """Whether numba's cache has an index for the module's parallel handler (then a build loads it: a stale
    index, e.g. for another CPU, only means that build compiles, as without the check)."""
    try:
        from numba.core.caching import FunctionCache

        handler = importlib.import_module(kernel_module)._handler_parallel
        return os.path.exists(FunctionCache(handler)._cache_file._index_path)
    except Exception:  # noqa: BLE001 - numba's cache layout is not public API: assume a cold cache
        return False


def fill_cache_alongside(kernel_modules: list[str]) -> list[subprocess.Popen]:
    """Start one child process per module that compiles its handler into numba's cache (at most one per core
    left to this process); the caller builds its own kernel meanwhile, then ``wait``s."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    children = []
    for module in kernel_modules[: max(0, cores - 1)]:
        children.append(subprocess.Popen([sys.executable, "-m", __name__, module], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return children


def wait(children: list[subprocess.Popen], timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Wait for ``fill_cache_alongside``'s children; one that fails or overruns is only logged (the build in this
    process then compiles that kernel itself, as without the children)."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            _, err = child.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
        if child.returncode != 0:
            log.warning("compiling a CPU kernel in %s failed (exit %s): %s", child.args[-1], child.returncode,
                        (err or b"").decode(errors="replace").strip()[-500:])


@contextlib.contextmanager
def _compiling(kernel_module: str):
    """Hold the host-wide lock of ``kernel_module``'s build (a file lock: released when its process dies)."""
    path = os.path.join(tempfile.gettempdir(), f"pipejax-numba-{kernel_module}-{os.getuid()}.lock")
    with open(path, "a") as f:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        locked = False
        while not locked and time.monotonic() < deadline:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                time.sleep(0.05)
        if not locked:
            log.warning("%s's build lock %s is still held after %.0f s; building without it", kernel_module,
                        path, LOCK_TIMEOUT_S)
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


if __name__ == "__main__":  # a child of fill_cache_alongside: compile one kernel into numba's cache
    logging.basicConfig(level=logging.WARNING)
    with _compiling(sys.argv[1]):
        compile_handler(sys.argv[1], sys.argv[1])
