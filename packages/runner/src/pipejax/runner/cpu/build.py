"""Building a CPU kernel's XLA FFI handler and registering it with XLA, for ``cpu_decode_attention`` and
``cpu_dense`` (numba is imported only inside ``build``: the kernel modules load it on first use).

numba compiles a kernel on one thread, under a process-wide lock, into its on-disk cache (~5-10 s per kernel on
a 2-core EPYC; a cache hit loads in well under a second). So a fresh install's first start, which needs several
kernels, fills the cache of all but one in child processes while this process builds the first
(``fill_cache_alongside``), and every build holds a per-kernel file lock: stages starting at once on a host
compile each kernel once, the others load it from the cache. A stage that will not wait for that
(``select``'s "background" build) has a ``BackgroundBuild`` fill the cache in a child process at a lower
priority while it runs XLA's formulation.
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


class BackgroundBuild:
    """numba's cache filled with ``kernel_modules`` by one child process (and its own children, one per spare
    core) at a lower CPU priority than the caller; ``finished()`` polls it. The child is not ended with the
    caller: what it compiles serves the host's next start."""

    NICENESS = 10

    def __init__(self, kernel_modules: list[str]):
        self.kernel_modules = kernel_modules
        self._errors = tempfile.TemporaryFile()  # a pipe could fill up and stop the child: nobody reads it early
        self.process = subprocess.Popen([sys.executable, "-m", __name__, "--nice", *kernel_modules],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._errors)
        self.started = time.monotonic()

    def finished(self) -> bool:
        """Whether the child has ended (one that failed is logged once, here: the caller keeps XLA's
        formulation)."""
        if self.process.poll() is None:
            return False
        if self._errors is not None:
            if self.process.returncode != 0:
                self._errors.seek(0)
                log.warning("building the CPU kernels %s in the background failed (exit %s): %s",
                            ", ".join(self.kernel_modules), self.process.returncode,
                            self._errors.read().decode(errors="replace").strip()[-500:])
            self._errors.close()
            self._errors = None
        return True

    @property
    def succeeded(self) -> bool:
        return self.finished() and self.process.returncode == 0


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


def _main(argv: list[str]) -> None:
    """A child of ``fill_cache_alongside`` (one module) or of ``BackgroundBuild`` (``--nice`` and modules):
    compile them into numba's cache, the first here and the others alongside."""
    logging.basicConfig(level=logging.WARNING)
    if argv[0] == "--nice":
        os.nice(BackgroundBuild.NICENESS)
        argv = argv[1:]
    children = fill_cache_alongside(argv[1:])
    try:
        with _compiling(argv[0]):
            compile_handler(argv[0], argv[0])
    finally:
        wait(children)
    for module in argv[1:]:  # one a child could not build (or no spare core took): here
        if not cached(module):
            with _compiling(module):
                compile_handler(module, module)


if __name__ == "__main__":
    _main(sys.argv[1:])
