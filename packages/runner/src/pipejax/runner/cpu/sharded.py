"""A CPU kernel on a stage's mesh: over ``tp`` devices, each device runs it on its own heads (``shard_map``)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pipejax.pp_utils import TP_AXIS

CACHE_SPEC = P(None, None, None, TP_AXIS, None)  # a paged cache [L, N, block_size, K, D], split over its KV heads


def on_each_device(kernel: Callable, mesh: Mesh, in_specs: tuple, out_specs) -> Callable:
    """``kernel`` itself on a one-device mesh; else ``kernel`` under ``shard_map``: its first ``len(in_specs)``
    arguments are arrays split as ``in_specs`` say (a scalar, e.g. the layer, as int32), the rest static values
    that every device gets as they are."""
    if mesh.devices.size == 1:
        return kernel

    def sharded(*args):
        arrays, static = args[:len(in_specs)], args[len(in_specs):]

        def local(*arrays):
            return kernel(*arrays, *static)

        arrays = [jnp.asarray(a, jnp.int32) if jnp.ndim(a) == 0 else a for a in arrays]
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*arrays)

    return sharded
