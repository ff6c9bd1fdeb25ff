"""vLLM general plugin (``vllm.general_plugins`` entry point): process-wide fixes vLLM needs when it
runs on pipejax's platform, which the platform itself (a torch-free layer) cannot make.

vLLM calls ``register`` in every process it starts (engine core, workers). On pipejax's platform
the engine core's last shutdown step empties the torch accelerator's cache (vLLM does so on every
platform but its own CPU one), and with no torch accelerator that raises: a traceback at every
exit. pipejax keeps nothing in torch's allocator, so with no accelerator there is nothing to empty.
"""

from __future__ import annotations

import functools


def register() -> None:
    import torch
    import vllm.platforms

    if type(vllm.platforms.current_platform).__name__ != "PipejaxPlatform":
        return
    for name in ("empty_cache", "empty_host_cache"):
        fn = getattr(torch.accelerator, name, None)
        if fn is not None and not hasattr(fn, "__pipejax_wrapped__"):
            setattr(torch.accelerator, name, _only_with_an_accelerator(fn))


def _only_with_an_accelerator(fn):
    import torch

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if torch.accelerator.is_available() else None

    wrapper.__pipejax_wrapped__ = True
    return wrapper
