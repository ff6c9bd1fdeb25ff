"""What travels with every activation step over the transfer server besides the data: the descriptor (names,
shapes, dtypes and each shard's place, as JSON in a ``uint8[DESCRIPTOR_BYTES]`` array), and the pull plan a
receiver makes from it (``transfer_transport`` says why every step is published as these two pulls)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pipejax.pp_utils.intermediate import IntermediateSpec, IntermediateTensors, SpecMismatchError

DESCRIPTOR_BYTES = 4096

Layout = list[list[list[int]]]  # per buffer, per dimension: [start, stop]


def _layout(indices: Sequence[tuple[slice, ...]], shape: Sequence[int]) -> Layout:
    return [[list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)] for index in indices]


def _array_layout(array: jax.Array) -> Layout:
    return _layout([shard.index for shard in array.addressable_shards], array.shape)


def _sharding_layout(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> Layout:
    return _layout(list(sharding.addressable_devices_indices_map(tuple(shape)).values()), shape)


def describe_array(array: jax.Array) -> dict[str, Any]:
    sharding = array.sharding
    entry: dict[str, Any] = {
        "shape": list(array.shape),
        "dtype": np.dtype(array.dtype).name,
        "layout": _array_layout(array),
    }
    if isinstance(sharding, NamedSharding):
        entry["mesh"] = {"names": list(sharding.mesh.axis_names), "sizes": list(sharding.mesh.devices.shape)}
        entry["pspec"] = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    return entry


def encode(descriptor: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(descriptor, separators=(",", ":")).encode()
    if len(raw) > DESCRIPTOR_BYTES:
        raise ValueError(
            f"activation descriptor is {len(raw)} bytes, over DESCRIPTOR_BYTES={DESCRIPTOR_BYTES}; "
            f"send fewer or less finely sharded tensors per step"
        )
    out = np.zeros(DESCRIPTOR_BYTES, np.uint8)
    out[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def decode(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.rstrip(b"\0"))


def _sender_sharding_on(entry: dict[str, Any], devices: Sequence[jax.Device]) -> jax.sharding.Sharding | None:
    """The sender's sharding rebuilt over ``devices``, or None where it cannot be."""
    if len(entry["layout"]) == 1:
        return SingleDeviceSharding(devices[0])
    if "mesh" not in entry:
        return None
    sizes = entry["mesh"]["sizes"]
    if int(np.prod(sizes)) > len(devices):
        return None
    mesh = Mesh(np.array(list(devices)[: int(np.prod(sizes))]).reshape(sizes), tuple(entry["mesh"]["names"]))
    pspec = PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in entry["pspec"]])
    return NamedSharding(mesh, pspec)


@dataclasses.dataclass(frozen=True)
class PullPlan:
    """How to pull one spec's data, learned from a descriptor; reused while the sender's descriptor is the same."""

    key: tuple  # the receiving spec (spec_key) it was made for
    descriptor: bytes  # the raw descriptor it was made from
    entries: tuple[dict[str, Any], ...]  # the sender's entry per tensor, in spec order
    structs: tuple[jax.ShapeDtypeStruct, ...]  # the data pull
    shardings: tuple[jax.sharding.Sharding, ...]  # the pull's shardings, in spec order

    def buffer_bytes(self) -> list[list[int]]:
        """Bytes of every buffer the data pull receives, per tensor."""
        return [
            [int(np.prod([b - a for a, b in index])) * np.dtype(e["dtype"]).itemsize for index in e["layout"]]
            for e in self.entries
        ]


def spec_key(spec: IntermediateSpec) -> tuple:
    return tuple((name, tuple(s.shape), s.dtype, s.sharding) for name, s in spec.tensors.items())


def make_plan(key: tuple, raw: bytes, spec: IntermediateSpec, step_id: int, peer: str) -> PullPlan:
    """Check a descriptor against ``spec`` (``SpecMismatchError``) and plan the data pull it describes."""
    try:
        descriptor = decode(raw)
    except ValueError as e:  # not JSON: not ours
        raise SpecMismatchError(f"step {step_id}: {peer} published something that is not a pipejax activation") from e
    _check_descriptor(descriptor, spec, step_id, peer)
    entries = tuple(descriptor["tensors"][n] for n in spec.names())
    shardings = tuple(_pull_sharding(n, e, spec, step_id) for n, e in zip(spec.names(), entries, strict=True))
    structs = tuple(
        jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=sh)
        for s, sh in zip(spec.tensors.values(), shardings, strict=True)
    )
    return PullPlan(key, raw, entries, structs, shardings)


def check_misguessed(guess: PullPlan, plan: PullPlan, step_id: int, peer: str) -> bool:
    """The data were pulled with ``guess`` but the sender's layout is ``plan``'s: usable as they are (False),
    only after putting their bytes back in place (True), or lost (ValueError)."""
    if guess.shardings == plan.shardings and guess.structs == plan.structs:
        return False
    if len(guess.entries) == len(plan.entries) and guess.buffer_bytes() == plan.buffer_bytes():
        return True  # every buffer landed whole, in a differently shaped shard
    raise ValueError(
        f"step {step_id}: {peer} changed how it lays out activations of the same shapes since an earlier "
        f"step, and this step's data were already pulled in the old layout and are lost; keep a stage's "
        f"output sharding fixed per shape (a new layout arrives intact from the next step on)"
    )


def reassemble(
    array: jax.Array, pulled: jax.sharding.Sharding, entry: dict[str, Any], target: jax.sharding.Sharding
) -> jax.Array:
    """Data pulled in the wrong layout: buffer ``i`` went whole into the pull's shard ``i``; put it in place."""
    shape = tuple(entry["shape"])
    out = np.empty(shape, np.dtype(entry["dtype"]))
    shards = {s.device: s for s in array.addressable_shards}
    for device, index in zip(pulled.addressable_devices_indices_map(shape), entry["layout"], strict=True):
        piece = np.asarray(shards[device].data).reshape(-1).view(out.dtype).reshape([b - a for a, b in index])
        out[tuple(slice(a, b) for a, b in index)] = piece
    return jax.device_put(out, target)


def devices_of(sharding: jax.sharding.Sharding) -> list[jax.Device]:
    return sorted(sharding.addressable_devices, key=lambda d: d.id)


def _check_descriptor(descriptor: dict[str, Any], spec: IntermediateSpec, step_id: int, peer: str) -> None:
    if descriptor.get("pipejax") != 1:
        raise SpecMismatchError(f"step {step_id}: {peer} published something that is not a pipejax activation")
    sent = IntermediateTensors(
        {k: jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"])) for k, e in descriptor["tensors"].items()}
    )
    spec.check(sent, step_id=step_id, peer=peer)


def _pull_sharding(name: str, entry: dict[str, Any], spec: IntermediateSpec, step_id: int) -> jax.sharding.Sharding:
    """A sharding whose shards match the sender's buffers one to one: the target's where it can."""
    shape = entry["shape"]
    target = spec.tensors[name].sharding
    if target is not None and _sharding_layout(target, shape) == entry["layout"]:
        return target
    devices = devices_of(target) if target is not None else jax.local_devices()
    rebuilt = _sender_sharding_on(entry, devices)
    if rebuilt is None or _sharding_layout(rebuilt, shape) != entry["layout"]:
        raise ValueError(
            f"step {step_id}: {name!r} arrives in {len(entry['layout'])} shards laid out in a way this "
            f"stage cannot rebuild on its {len(devices)} device(s); send it with a NamedSharding over at most "
            f"{len(devices)} devices, or in the receiver's layout"
        )
    return rebuilt
