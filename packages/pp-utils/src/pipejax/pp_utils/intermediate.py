"""Activations that cross a pipeline-stage boundary, and their abstract description."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a receiving stage needs to pull one array: shape, dtype and target sharding."""

    shape: tuple[int, ...]
    dtype: str
    sharding: jax.sharding.Sharding | None = None

    @classmethod
    def of(cls, array: Any, sharding: jax.sharding.Sharding | None = None) -> TensorSpec:
        return cls(tuple(array.shape), np.dtype(array.dtype).name, sharding)

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"

    def shape_dtype_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, np.dtype(self.dtype), sharding=self.sharding)


@jax.tree_util.register_pytree_node_class
class IntermediateTensors(Mapping):
    """Named arrays (``hidden_states``, ``residual``, ...) passed from one stage to the next.

    A pytree whose leaves are the arrays in sorted-name order, so it goes through ``jax.jit``,
    ``jax.device_put`` and the transfer server like any other pytree.
    """

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = dict(sorted(tensors.items()))

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        # Leaves need not be arrays: the same pytree also carries shardings or in_axes.
        def show(v: Any) -> str:
            return TensorSpec.of(v).describe() if hasattr(v, "shape") and hasattr(v, "dtype") else repr(v)

        inner = ", ".join(f"{k}={show(v)}" for k, v in self.tensors.items())
        return f"IntermediateTensors({inner})"

    def tree_flatten(self):
        return tuple(self.tensors.values()), tuple(self.tensors.keys())

    @classmethod
    def tree_unflatten(cls, names, arrays):
        return cls(dict(zip(names, arrays, strict=True)))

    def spec(self, sharding: Mapping[str, jax.sharding.Sharding] | None = None) -> IntermediateSpec:
        sharding = sharding or {}
        return IntermediateSpec({k: TensorSpec.of(v, sharding.get(k)) for k, v in self.tensors.items()})


@dataclasses.dataclass(frozen=True)
class IntermediateSpec:
    """The abstract form of an ``IntermediateTensors``: one ``TensorSpec`` per name."""

    tensors: Mapping[str, TensorSpec]

    def __post_init__(self):
        object.__setattr__(self, "tensors", dict(sorted(self.tensors.items())))

    def names(self) -> tuple[str, ...]:
        return tuple(self.tensors)

    def nbytes(self) -> int:
        return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in self.tensors.values())

    def describe(self) -> str:
        return "{" + ", ".join(f"{k}: {s.describe()}" for k, s in self.tensors.items()) + "}"

    def check(self, tensors: IntermediateTensors, *, step_id: Any, peer: str) -> None:
        """Raise ``SpecMismatchError`` unless ``tensors`` have exactly these names, shapes and dtypes."""
        got = {k: TensorSpec.of(v) for k, v in tensors.items()}
        want = {k: dataclasses.replace(s, sharding=None) for k, s in self.tensors.items()}
        if got != want:
            raise SpecMismatchError(
                f"step {step_id}: activations from {peer} are {IntermediateSpec(got).describe()} but the "
                f"receiving stage expects {IntermediateSpec(want).describe()}; both stages must be built "
                f"from the same model config and batch bucket"
            )


class SpecMismatchError(ValueError):
    """Received activations do not match what the receiving stage expects."""
