"""Model implementations: the native JAX one, and others found through the ``pipejax.model_impls``
entry-point group (e.g. the torchax bridge), so the runner never imports them.

An implementation loads one stage's parameters and provides the stage forward with the native
signature: ``forward(params, kv_cache, inputs, hidden_in, *, cfg, stage, shape,
block_size) -> (hidden [T, E] | logits [R, V], kv_cache)``. The KV cache layout, the batch
inputs and the sampler stay the runner's, so scheduling, paging and preemption are shared.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pipejax.runner.checkpoint import load_stage_params
from pipejax.runner.model import stage_forward

ENTRY_POINT_GROUP = "pipejax.model_impls"


@dataclasses.dataclass(frozen=True)
class ModelImpl:
    name: str
    load_params: Callable[..., Any]  # (path, cfg: ModelConfig, stage: StageConfig, mesh) -> params pytree
    forward: Callable[..., Any]


NATIVE = ModelImpl("jax", load_stage_params, stage_forward)


@functools.cache
def get_model_impl(name: str = "jax") -> ModelImpl:
    """``"jax"`` is built in; any other name is looked up in the ``pipejax.model_impls`` group."""
    if name == "jax":
        return NATIVE
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        known = ", ".join(["jax", *sorted(found)])
        hint = " (pip install pipejax-torchax-bridge)" if name == "torchax" else ""
        raise ValueError(f"unknown model implementation {name!r}; available: {known}{hint}")
    impl = found[name].load()
    impl = impl() if callable(impl) and not isinstance(impl, ModelImpl) else impl
    if not isinstance(impl, ModelImpl):
        raise TypeError(f"entry point {name!r} in {ENTRY_POINT_GROUP} gave {impl!r}, not a ModelImpl")
    return impl
