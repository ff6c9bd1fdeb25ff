"""Stage meshes over disjoint devices, and logical-axis sharding rules.

Parameters and activations are described with *logical* axis names (``"embed"``, ``"heads"``,
``"mlp"``...). A ``ShardingRules`` object maps each logical name to a mesh axis (or to
nothing = replicated); ``logical_to_pspec`` turns a tuple of logical names into a
``PartitionSpec`` and refuses a spec that would put one mesh axis on two dimensions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"


def stage_devices(devices: Sequence[jax.Device], pp_size: int, tp_size: int) -> list[list[jax.Device]]:
    """Split ``devices`` into ``pp_size`` disjoint groups of ``tp_size``, in order."""
    if pp_size < 1 or tp_size < 1:
        raise ValueError(f"pp_size={pp_size} and tp_size={tp_size} must both be >= 1")
    need = pp_size * tp_size
    if len(devices) < need:
        listing = ", ".join(f"{d.platform}:{d.id}" for d in devices) or "none"
        raise ValueError(
            f"pp_size={pp_size} x tp_size={tp_size} needs {need} devices but only {len(devices)} exist "
            f"({listing}); lower pp/tp, or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            f"before JAX is imported"
        )
    return [list(devices[i * tp_size : (i + 1) * tp_size]) for i in range(pp_size)]


def stage_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh with axis ``tp`` over one stage's devices."""
    return Mesh(np.array(list(devices)), (TP_AXIS,))


def stage_meshes(devices: Sequence[jax.Device], pp_size: int, tp_size: int) -> list[Mesh]:
    """One ``tp``-axis mesh per stage, over disjoint devices."""
    return [stage_mesh(group) for group in stage_devices(devices, pp_size, tp_size)]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name (None = replicated). Unknown names are replicated."""

    rules: Mapping[str, str | None]

    def __post_init__(self):
        object.__setattr__(self, "rules", dict(self.rules))

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else self.rules.get(logical)


def logical_to_pspec(logical_axes: Sequence[str | None], rules: ShardingRules) -> PartitionSpec:
    """('embed', 'heads', None) -> PartitionSpec(None, 'tp', None) under the rules.

    Two dimensions mapped to the same mesh axis is a ``ValueError`` that names both.
    """
    used: dict[str, str] = {}
    out = []
    for logical in logical_axes:
        axis = rules.mesh_axis(logical)
        if axis is not None:
            if axis in used:
                raise ValueError(
                    f"logical axes {used[axis]!r} and {logical!r} of {tuple(logical_axes)} both map to mesh "
                    f"axis {axis!r}; a mesh axis may shard only one dimension, map one of them to None"
                )
            used[axis] = logical
        out.append(axis)
    return PartitionSpec(*out)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_pspec(logical_axes, rules))
