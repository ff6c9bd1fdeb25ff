"""Compiled-graph edges whose readers sleep: one ZMQ PUSH -> PULL socket pair per edge.

Ray's own compiled-graph channel (shared memory, Ray 2.60) waits for the next value by polling its
header with ``sched_yield`` in a loop, so every idle reader keeps a core busy: the driver waiting for
the last stage, and every stage actor waiting for its predecessor. With pp stages on a host with few
cores, those spinning readers take the cores the stages' own steps need (BENCHMARKS.md: 2.00 of 2
cores busy in every compiled-graph run). A reader here blocks in ``zmq_poll`` instead, woken by the
message itself.

Only pipejax's small control messages ride these edges (a step's batch and its status); activations
go through the PP transport, as in every mode. The writer binds (Ray creates an edge's channel in
the writer's process) one PUSH socket per reader on its node's IP (an ephemeral port); each reader connects
its PULL socket to its own.
"""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from typing import Any

import ray
import zmq
from ray import cloudpickle
from ray.exceptions import RayChannelError, RayChannelTimeoutError
from ray.experimental.channel.common import ChannelInterface, ChannelOutputType

_POLL_SLICE_S = 0.05  # a blocked read looks at ``close`` this often (teardown closes from another thread)
_SEND_HWM = 1024  # control messages queued per edge before a write waits (far above max in-flight steps)


class _Endpoint:
    """This process's end of one edge. Kept per process, by channel id, not on the channel object: Ray
    pickles channel objects between processes (the writer's to the driver and back into its task list,
    and a fresh copy into the teardown call that closes them), so every copy must find the same socket
    and see the same ``close``."""

    def __init__(self, sockets: list[zmq.Socket]):
        self.sockets = sockets  # the writer's, one per reader; a reader's one
        self.sent = 0  # the writer's: readers given the value being written (a write resumed after a timeout)
        self.closed = False
        self.lock = threading.Lock()  # a socket is used by one thread at a time (read/write vs close)

    def close_sockets(self) -> None:
        for socket in self.sockets:
            socket.close(linger=0)
        self.sockets = []


_endpoints: dict[str, _Endpoint] = {}
_endpoints_lock = threading.Lock()


class WaitingChannelType(ChannelOutputType):
    """Type hint for a graph edge (``node.type_hint = WaitingChannelType()``) whose readers wait without
    spinning. Its readers are actors, or the driver alone."""

    def __init__(self, first_reader=None):
        """``first_reader``: the actor a write reaches first (Ray lists an edge's readers in no set order)."""
        self.first_reader = first_reader

    def create_channel(self, writer, reader_and_node_list, driver_actor_id=None) -> ChannelInterface:
        reader_ids = [handle._actor_id.hex() for handle, _ in reader_and_node_list]
        if self.first_reader is not None and self.first_reader._actor_id.hex() in reader_ids:
            first = self.first_reader._actor_id.hex()
            reader_ids.sort(key=lambda actor_id: actor_id != first)
        reader_ids = tuple(reader_ids)
        return WaitingChannel.bind(ray.util.get_node_ip_address(), reader_ids)


class WaitingChannel(ChannelInterface):
    """One graph edge: ``write`` in the writer's process, ``read`` in the reader's; values are pickled."""

    def __init__(self, channel_id: str, addresses: tuple[str, ...], reader_ids: tuple[str, ...]):
        self.channel_id = channel_id
        self.addresses = addresses  # one per reader, in ``reader_ids`` order
        self.reader_ids = reader_ids  # the readers' actor ids (one reader: whichever process reads)

    @classmethod
    def bind(cls, host: str, reader_ids: tuple[str, ...]) -> WaitingChannel:
        hostport = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
        sockets = [_socket(zmq.PUSH, hostport) for _ in reader_ids]
        addresses = [f"tcp://{hostport}:{socket.bind_to_random_port(f'tcp://{hostport}')}" for socket in sockets]
        channel = cls(uuid.uuid4().hex, tuple(addresses), reader_ids)
        with _endpoints_lock:
            _endpoints[channel.channel_id] = _Endpoint(sockets)
        return channel

    def __reduce__(self):
        return WaitingChannel, (self.channel_id, self.addresses, self.reader_ids)

    def __repr__(self) -> str:
        return f"WaitingChannel({self.channel_id[:8]}, {len(self.addresses)} reader(s), {self.addresses[0]}...)"

    # -- ChannelInterface ---------------------------------------------------------------------

    def ensure_registered_as_writer(self) -> None:
        if self.channel_id not in _endpoints:
            raise RayChannelError(f"{self!r} is written only in the process that created it")

    def ensure_registered_as_reader(self) -> None:
        self._endpoint()

    def write(self, value: Any, timeout: float | None = None) -> None:
        endpoint = _endpoints.get(self.channel_id)
        if endpoint is None:
            raise RayChannelError(f"{self!r} is written only in the process that created it")
        try:
            payload = pickle.dumps(value, protocol=5)
        except (pickle.PicklingError, AttributeError, TypeError):  # e.g. a RayTaskError(<cause>) class made at run time
            payload = cloudpickle.dumps(value, protocol=5)
        deadline = _deadline(timeout)
        while True:
            with endpoint.lock:
                self._open(endpoint)
                while endpoint.sent < len(endpoint.sockets):
                    socket = endpoint.sockets[endpoint.sent]
                    try:
                        socket.send(payload, zmq.NOBLOCK)
                    except zmq.Again:  # no reader connected yet, or that far behind: wait as Ray's channel would
                        socket.poll(_slice(deadline), zmq.POLLOUT)
                        break
                    endpoint.sent += 1
                else:
                    endpoint.sent = 0
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise RayChannelTimeoutError(f"{self!r}: the reader took no value within {timeout} s")

    def read(self, timeout: float | None = None) -> Any:
        endpoint = self._endpoint()
        deadline = _deadline(timeout)
        while True:
            with endpoint.lock:
                socket = self._open(endpoint)[0]
                if socket.poll(_slice(deadline), zmq.POLLIN):
                    return pickle.loads(socket.recv(copy=False).buffer)
            if deadline is not None and time.monotonic() >= deadline:
                raise RayChannelTimeoutError(f"{self!r}: no value within {timeout} s")

    def release_buffer(self, timeout: float | None = None) -> None:
        """The driver drops a result nobody fetched: read it and let it go."""
        self.read(timeout)

    def close(self) -> None:
        with _endpoints_lock:
            endpoint = _endpoints.setdefault(self.channel_id, _Endpoint([]))
        endpoint.closed = True
        if endpoint.lock.acquire(blocking=False):  # else the thread inside read/write closes it within a slice
            try:
                endpoint.close_sockets()
            finally:
                endpoint.lock.release()

    # -- helpers ------------------------------------------------------------------------------

    def _endpoint(self) -> _Endpoint:
        """This process's end (the reader's connects on first use)."""
        with _endpoints_lock:
            endpoint = _endpoints.get(self.channel_id)
            if endpoint is None:
                address = self.addresses[self._reader_index()]
                socket = _socket(zmq.PULL, address)
                socket.connect(address)
                endpoint = _endpoints[self.channel_id] = _Endpoint([socket])
        return endpoint

    def _reader_index(self) -> int:
        if len(self.reader_ids) == 1:
            return 0
        me = ray.get_runtime_context().get_actor_id()
        if me not in self.reader_ids:
            raise RayChannelError(f"{self!r} is read by actors {self.reader_ids}, not by {me or 'the driver'}")
        return self.reader_ids.index(me)

    def _open(self, endpoint: _Endpoint) -> list[zmq.Socket]:
        if endpoint.closed or not endpoint.sockets:
            endpoint.close_sockets()
            raise RayChannelError(f"{self!r} is closed")
        return endpoint.sockets


def edge_ends_here() -> int:
    """How many edge ends (a writer's sockets, or a reader's) this process holds open."""
    with _endpoints_lock:
        return sum(1 for e in _endpoints.values() if e.sockets and not e.closed)


def give_waiting_edges(root) -> int:
    """Give every edge of the graph ending at ``root`` that has no transport of its own a ``WaitingChannelType``
    (for a graph someone else builds: vLLM's compiled-graph executor); returns how many edges it changed.
    Edges asked to carry tensors over an accelerator (``with_tensor_transport("nccl")``) keep their transport."""
    from ray.dag import ClassMethodNode, InputNode
    from ray.experimental.channel.auto_transport_type import AutoTransportType

    changed, seen, stack = 0, set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ClassMethodNode | InputNode) and type(node.type_hint) in (ChannelOutputType,
                                                                                   AutoTransportType):
            node.type_hint = WaitingChannelType()
            changed += 1
        stack.extend(node._get_all_child_nodes())
    return changed


def _socket(kind: int, where: str) -> zmq.Socket:
    """A PUSH (bounded queue) or PULL socket that drops unsent messages at close; IPv6 where ``where`` (a host or
    an address) is one."""
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
    if "[" in where:
        socket.setsockopt(zmq.IPV6, 1)
    return socket


def _deadline(timeout: float | None) -> float | None:
    """Ray's convention: None or -1 waits without end, 0 tries once."""
    if timeout is None or timeout < 0:
        return None
    return time.monotonic() + timeout


def _slice(deadline: float | None) -> int:
    """Milliseconds to block in one poll: up to the deadline, at most one slice."""
    if deadline is None:
        return int(_POLL_SLICE_S * 1000)
    return max(0, min(int(_POLL_SLICE_S * 1000), int((deadline - time.monotonic()) * 1000)))
