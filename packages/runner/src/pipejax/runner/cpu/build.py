"""Building a CPU kernel's XLA FFI handler and registering it with XLA, for ``cpu_decode_attention`` and
``cpu_dense`` (numba is imported only inside ``build``: the kernel modules load it on first use)."""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import Any

import jax

log = logging.getLogger(__name__)


def build_and_register(target: str, kernel_module: str, what: str, instead: str) -> Any:
    """``kernel_module``'s ``compile_handler(parallel=True)`` (numba's threads on TBB; where TBB cannot be loaded,
    on the calling thread, with a warning), registered as the CPU FFI target ``target``; None, with a warning
    naming ``what`` and what runs ``instead``, where numba cannot build it. Keep the handler alive as long as XLA
    may call it."""
    try:
        compile_handler = importlib.import_module(kernel_module).compile_handler
        try:
            handler = compile_handler(parallel=True)
        except Exception as e:  # noqa: BLE001 - no usable TBB: the kernel still runs, on one thread
            log.warning("the CPU %s kernel runs on one thread: its parallel build failed (%s: %s)",
                        what, type(e).__name__, e)
            handler = compile_handler(parallel=False)
    except Exception as e:  # noqa: BLE001 - a numba/LLVM that cannot build it: XLA's own formulation stays
        log.warning("the CPU %s kernel could not be built (%s: %s); using %s", what, type(e).__name__, e, instead)
        return None
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    jax.ffi.register_ffi_target(target, new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None), "cpu")
    return handler
