"""vLLM general plugin (``vllm.general_plugins`` entry point): process-wide fixes vLLM needs when it
runs on pipejax's platform, which the platform itself (a torch-free layer) cannot make.

vLLM calls ``register`` in every process it starts (engine core, workers). On pipejax's platform
the engine core's last shutdown step empties the torch accelerator's cache (vLLM does so on every
platform but its own CPU one), and with no torch accelerator that raises: a traceback at every
exit. pipejax keeps nothing in torch's allocator, so with no accelerator there is nothing to empty.

vLLM's compiled-graph Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) gets the graph edges pipejax's own
compiled graph has (``executor/graph_channel.py``): readers that sleep until their message comes, where Ray's
shared-memory channel keeps a core busy for each waiting reader (the engine core, every idle worker). Its edges
carry only pipejax's step handles; the activations take pipejax's transport either way.
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
    try:
        from vllm.v1.executor.ray_executor import RayDistributedExecutor
    except ImportError:  # vLLM without Ray
        return
    build = RayDistributedExecutor._compiled_ray_dag
    if not hasattr(build, "__pipejax_wrapped__"):
        RayDistributedExecutor._compiled_ray_dag = _with_waiting_edges(build)


def _only_with_an_accelerator(fn):
    import torch

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if torch.accelerator.is_available() else None

    wrapper.__pipejax_wrapped__ = True
    return wrapper


def _with_waiting_edges(build):
    """vLLM's ``_compiled_ray_dag`` with ``give_waiting_edges`` applied to the graph it builds, just before it is
    compiled (vLLM builds and compiles it in one method, once per engine)."""
    import logging

    from ray.dag import MultiOutputNode

    from pipejax.ray_executor.executor.graph_channel import give_waiting_edges

    @functools.wraps(build)
    def wrapper(self, *args, **kwargs):
        compile_graph = MultiOutputNode.experimental_compile

        def compile_with_waiting_edges(root, *a, **kw):
            changed = give_waiting_edges(root)
            logging.getLogger("pipejax").info("vLLM's compiled graph: %d edges on zmq (readers sleep)", changed)
            return compile_graph(root, *a, **kw)

        MultiOutputNode.experimental_compile = compile_with_waiting_edges
        try:
            return build(self, *args, **kwargs)
        finally:
            del MultiOutputNode.experimental_compile  # back to DAGNode's

    wrapper.__pipejax_wrapped__ = True
    return wrapper
