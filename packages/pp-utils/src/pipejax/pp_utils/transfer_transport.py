"""Stage-to-stage activations across processes and hosts, over JAX's transfer server.

Every stage process owns one ``TransferServerTransport``: a ``jax.experimental.transfer``
server bound to ``host`` (an ephemeral port), whose ``address`` the next stage connects to.
``send`` registers arrays on the local server and returns at once; ``receive`` pulls them from
the previous stage's server straight into the receiving stage's devices and shardings.

How the transfer server behaves (jax 0.10.2, checked on CPU) and what this module does about it:
- ``pull`` is positional and blind: the receiver names shapes and shardings, and shard ``i`` of
  the pull is filled with the bytes of the sender's ``i``-th buffer (the arrays' addressable
  shards, in order). A wrong guess is not reported: a smaller pull yields an array that fails
  on use, a pull with more shards than were sent never completes. So every step is published
  as two pulls: a fixed-size descriptor (JSON in a ``uint8[DESCRIPTOR_BYTES]`` array: names,
  shapes, dtypes and the index of every shard) and then the data. The receiver reads the
  descriptor first, raises ``SpecMismatchError`` on a name/shape/dtype mismatch, and pulls the
  data only with a layout it knows equals the sender's.
- Same layout on both sides (the usual case: every stage has the same TP and the same
  activation shardings) lands directly in the receiver's sharding. Otherwise the sender's
  ``NamedSharding`` is rebuilt over the receiver's devices, pulled into, then ``device_put``
  into the target sharding (one local reshard).
- If the sender's process goes away, pending and later pulls fail at once ("Connection closed");
  ``receive`` raises ``ConnectionError`` naming the step and the peer.
- ``pull`` returns at once; readiness is what waits, and a pull for an id that is never
  published never becomes ready (its ``timeout`` argument did not end it). ``receive`` polls
  ``is_ready()`` up to its deadline, so no thread is left blocked and the process can exit. A
  pull that timed out stays issued and is resumed by the next ``receive`` of that step.
- Data stay alive on the sender until pulled, then the server frees them (the caller may drop
  its references right after ``send``). A uuid is served once; publishing it again is refused
  here. Steps never pulled are dropped after ``unpulled_ttl_s`` (the server frees them lazily,
  on a later ``send``). A mismatched step is never pulled, so it waits for that TTL too.
- The server has no shutdown call: it lives as long as this object; ``close`` forgets the
  connection and the pending pulls.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pipejax.pp_utils.intermediate import IntermediateSpec, IntermediateTensors, SpecMismatchError
from pipejax.pp_utils.transport import DEFAULT_RECEIVE_TIMEOUT_S, ActivationTransport, TransportTimeout

DESCRIPTOR_BYTES = 4096
MAX_STEP_ID = 2**62 - 1  # two uuids per step must fit the server's uint64 ids
_RECENT_STEPS = 65536  # how many step ids are remembered to refuse a second send/receive
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3

Layout = list[list[list[int]]]  # per buffer, per dimension: [start, stop]


def _layout(indices: Sequence[tuple[slice, ...]], shape: Sequence[int]) -> Layout:
    return [[list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)] for index in indices]


def _array_layout(array: jax.Array) -> Layout:
    return _layout([shard.index for shard in array.addressable_shards], array.shape)


def _sharding_layout(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> Layout:
    return _layout(list(sharding.addressable_devices_indices_map(tuple(shape)).values()), shape)


def _describe_array(array: jax.Array) -> dict[str, Any]:
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


def _encode(descriptor: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(descriptor, separators=(",", ":")).encode()
    if len(raw) > DESCRIPTOR_BYTES:
        raise ValueError(
            f"activation descriptor is {len(raw)} bytes, over DESCRIPTOR_BYTES={DESCRIPTOR_BYTES}; "
            f"send fewer or less finely sharded tensors per step"
        )
    out = np.zeros(DESCRIPTOR_BYTES, np.uint8)
    out[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _decode(array: np.ndarray) -> dict[str, Any]:
    return json.loads(array.tobytes().rstrip(b"\0"))


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


@dataclasses.dataclass
class _PendingPull:
    """A receive in progress; kept across a timeout so a retry resumes it."""

    descriptor: jax.Array
    data: list[jax.Array] | None = None  # pulled arrays, sorted by name
    pull_shardings: list[jax.sharding.Sharding] | None = None


class TransferServerTransport(ActivationTransport):
    """One stage's end of the pipeline: serves ``send`` to the next stage, pulls ``receive`` from the previous.

    ``host``: the IP address to bind and advertise (port chosen by the OS); ``unpulled_ttl_s``: how
    long a sent step waits to be pulled before the server drops it; ``bulk_connections``: sockets
    for the bulk data. The default is 1, the same on every stage: a server whose peer opened more
    bulk connections than it has local devices aborts the process (jax 0.10.2), so the count is
    never derived from the device count.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        unpulled_ttl_s: float = 600.0,
        bulk_connections: int = 1,
    ):
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(f"host={host!r} cannot be advertised to peers; pass this host's reachable IP address")
        hostport = f"[{host}]:0" if ":" in host else f"{host}:0"
        connections = bulk_connections
        self._server = transfer.start_transfer_server(jax.local_devices()[0].client, hostport, [hostport] * connections)
        self.address: str = self._server.address()
        self.unpulled_ttl_s = unpulled_ttl_s
        self.peer = "previous stage (not connected)"
        self._conn: Any = None
        self._lock = threading.Lock()
        self._sent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._received: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pending: dict[int, _PendingPull] = {}

    def connect_previous(self, address: str, peer_name: str = "previous stage") -> None:
        """Connect to the previous stage's ``address``; ``receive`` pulls from it."""
        self._conn = self._server.connect(address)
        self.peer = f"{peer_name} at {address}"

    # -- sending ------------------------------------------------------------------------------

    def send(self, step_id: int, tensors: IntermediateTensors) -> None:
        _check_step_id(step_id)
        arrays = [v if isinstance(v, jax.Array) else jax.device_put(v) for v in tensors.values()]
        for name, array in zip(tensors, arrays, strict=True):
            if not array.is_fully_addressable:
                raise ValueError(f"step {step_id}: {name!r} spans processes; a stage must live in one process")
        descriptor = {"pipejax": 1, "tensors": {k: _describe_array(a) for k, a in zip(tensors, arrays, strict=True)}}
        home = arrays[0].addressable_shards[0].device if arrays else jax.local_devices()[0]
        encoded = jax.device_put(_encode(descriptor), home)
        with self._lock:
            if step_id in self._sent:
                raise ValueError(f"step {step_id} was already sent from {self.address}; step ids must be unique")
            _remember(self._sent, step_id)
        expires = datetime.datetime.now() + datetime.timedelta(seconds=self.unpulled_ttl_s)
        # Data first: once the receiver sees the descriptor, the data are already published.
        self._server.await_pull(2 * step_id + 1, arrays, timeout=expires)
        self._server.await_pull(2 * step_id, [encoded], timeout=expires)

    # -- receiving ----------------------------------------------------------------------------

    def receive(
        self, step_id: int, spec: IntermediateSpec, timeout: float = DEFAULT_RECEIVE_TIMEOUT_S
    ) -> IntermediateTensors:
        _check_step_id(step_id)
        if self._conn is None:
            raise RuntimeError(f"receive(step {step_id}) before connect_previous(); connect to the previous stage")
        deadline = time.monotonic() + timeout
        with self._lock:
            if step_id in self._received:
                raise ValueError(f"step {step_id} was already received from {self.peer}; each step is pulled once")
            pending = self._pending.get(step_id)
            if pending is None:
                home = _home_device(spec)
                struct = jax.ShapeDtypeStruct((DESCRIPTOR_BYTES,), np.uint8, sharding=SingleDeviceSharding(home))
                pending = self._pending[step_id] = _PendingPull(self._conn.pull(2 * step_id, [struct])[0])

        self._wait([pending.descriptor], step_id, timeout, deadline)
        descriptor = _decode(np.asarray(pending.descriptor))
        if pending.data is None:
            try:
                _check_descriptor(descriptor, spec, step_id, self.peer)
                shardings = [_pull_sharding(n, descriptor["tensors"][n], spec, step_id) for n in spec.names()]
            except ValueError:
                with self._lock:
                    self._pending.pop(step_id, None)
                raise
            structs = [
                jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=sh)
                for s, sh in zip(spec.tensors.values(), shardings, strict=True)
            ]
            pending.pull_shardings = shardings
            pending.data = self._conn.pull(2 * step_id + 1, structs)
        self._wait(pending.data, step_id, timeout, deadline)

        with self._lock:
            del self._pending[step_id]
            _remember(self._received, step_id)
        out = {}
        for name, array, pulled in zip(spec.names(), pending.data, pending.pull_shardings, strict=True):
            target = spec.tensors[name].sharding
            out[name] = array if target is None or target == pulled else jax.device_put(array, target)
        return IntermediateTensors(out)

    def _wait(self, arrays: list[jax.Array], step_id: int, timeout: float, deadline: float) -> None:
        # Polled, not blocked on in a helper thread: a thread left inside block_until_ready on a
        # pull that never completes aborts the interpreter at exit ("FATAL: exception not rethrown").
        pause = _POLL_MIN_S
        while not all(a.is_ready() for a in arrays):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(
                    f"step {step_id}: no activations from {self.peer} after {timeout:.1f}s; "
                    f"is the previous stage running and using the same step ids?"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, _POLL_MAX_S)
        try:
            jax.block_until_ready(arrays)  # ready by now; raises if the pull failed
        except jax.errors.JaxRuntimeError as e:
            with self._lock:
                self._pending.pop(step_id, None)
            raise ConnectionError(
                f"step {step_id}: pulling activations from {self.peer} failed ({e}); did that stage's process exit?"
            ) from e

    def pending(self) -> int:
        """Receives that timed out and can be resumed."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._conn = None
        self._pending.clear()


def _check_step_id(step_id: int) -> None:
    if not isinstance(step_id, int | np.integer) or not 0 <= step_id <= MAX_STEP_ID:
        raise ValueError(f"step_id={step_id!r} must be an int in [0, {MAX_STEP_ID}]")


def _remember(recent: collections.OrderedDict[int, None], step_id: int) -> None:
    recent[step_id] = None
    if len(recent) > _RECENT_STEPS:
        recent.popitem(last=False)


def _home_device(spec: IntermediateSpec) -> jax.Device:
    for s in spec.tensors.values():
        if s.sharding is not None:
            return _devices_of(s.sharding)[0]
    return jax.local_devices()[0]


def _devices_of(sharding: jax.sharding.Sharding) -> list[jax.Device]:
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
    devices = _devices_of(target) if target is not None else jax.local_devices()
    rebuilt = _sender_sharding_on(entry, devices)
    if rebuilt is None or _sharding_layout(rebuilt, shape) != entry["layout"]:
        raise ValueError(
            f"step {step_id}: {name!r} arrives in {len(entry['layout'])} shards laid out in a way this "
            f"stage cannot rebuild on its {len(devices)} device(s); send it with a NamedSharding over at most "
            f"{len(devices)} devices, or in the receiver's layout"
        )
    return rebuilt
