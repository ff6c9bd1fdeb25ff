"""Stage-to-stage activations across processes and hosts, over JAX's transfer server.

Every stage process owns one ``TransferServerTransport``: a ``jax.experimental.transfer``
server bound to ``host`` (an ephemeral port), whose ``address`` the next stage connects to.
``send`` registers arrays on the local server and returns at once; ``receive`` pulls them from
the previous stage's server straight into the receiving stage's devices and shardings.

How the transfer server behaves (jax 0.10.2, checked on CPU) and what this module does about it:
- ``pull`` is positional and blind: the receiver names shapes and shardings, and shard ``i`` of
  the pull is filled with the bytes of the sender's ``i``-th buffer (the arrays' addressable
  shards, in order). A wrong guess is reported only where the byte counts differ: a shard larger
  or smaller than its buffer, or more shards than buffers, fail the pull within a round trip; the
  same bytes in another shape (or dtype) arrive reinterpreted, and fewer shards than buffers just
  take the first ones. Either way the uuid is used up, and the connection keeps working.
- So every step is published as two pulls: a fixed-size descriptor (JSON in a
  ``uint8[DESCRIPTOR_BYTES]`` array: names, shapes, dtypes and the index of every shard; encoded
  once per layout and reused) and the data. The first step of a spec pulls the descriptor, raises
  ``SpecMismatchError`` on a name/shape/dtype mismatch, and only then pulls the data, in the
  sender's layout. That plan is kept per spec: later steps issue the data pull in it at once,
  next to the descriptor's (one round trip, not two), and accept the data only when the descriptor
  is byte for byte the one the plan was made from; otherwise the descriptor is checked as above
  (``SpecMismatchError``, the speculative pull is dropped). If the sender changed its layout for
  the same shapes, data whose buffers kept their sizes are put back in place on the host; other
  sizes lose that step (``ValueError``); the next step uses the new plan.
- Same layout on both sides (the usual case: every stage has the same TP and the same
  activation shardings) lands directly in the receiver's sharding. Otherwise the sender's
  ``NamedSharding`` is rebuilt over the receiver's devices, pulled into, then ``device_put``
  into the target sharding (one local reshard).
- If the sender's process goes away, pending and later pulls fail at once ("Connection closed");
  ``receive`` raises ``ConnectionError`` naming the step and the peer.
- ``pull`` returns at once; readiness is what waits, and a pull for an id that is never
  published never becomes ready (its ``timeout`` argument did not end it). ``receive`` polls
  ``is_ready()`` up to its deadline, so no thread is left blocked and the process can exit (a thread
  blocked on such a pull aborts the interpreter at exit). Each readiness query leaks a little native
  memory in jaxlib 0.10.2 (``benchmarks/transfer_pull_memory.py``), so queries are spaced: every
  ``_SPIN_CHECK_S`` while spinning for the first ``_SPIN_S``, then after sleeps of a small fraction of
  the time waited; ``readiness_checks`` counts them. A pull that timed out stays
  issued and is resumed by the next ``receive`` of that step.
- Data stay alive on the sender until pulled, then the server frees them (the caller may drop
  its references right after ``send``, but must not delete or donate the arrays before they are
  pulled: that pull then fails. ``use_raw_buffers=True`` would allow it, but made a 6 MB pull
  about 1 ms slower here). A uuid is served once; publishing it again is refused here. Steps
  never pulled are dropped after ``unpulled_ttl_s`` (the server frees them lazily, on a later
  ``send``); so are the data of a mismatched step that were not pulled.
- The server has no shutdown call: it lives as long as this object; ``close`` forgets the
  connection and the pending pulls.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from pipejax.pp_utils.intermediate import IntermediateSpec, IntermediateTensors
from pipejax.pp_utils.transfer_descriptor import (
    DESCRIPTOR_BYTES,
    PullPlan,
    check_misguessed,
    describe_array,
    devices_of,
    encode,
    make_plan,
    reassemble,
    spec_key,
)
from pipejax.pp_utils.transport import (
    DEFAULT_RECEIVE_TIMEOUT_S,
    ActivationTransport,
    TransportAborted,
    TransportTimeout,
)

MAX_STEP_ID = 2**62 - 1  # two uuids per step must fit the server's uint64 ids
_RECENT_STEPS = 65536  # how many step ids are remembered to refuse a second send/receive
_SPIN_S = 300e-6  # how long a wait spins before it sleeps
_SPIN_CHECK_S = 25e-6  # while spinning, how often readiness is queried (each query leaks, see above)
_POLL_MIN_S, _POLL_MAX_S, _POLL_FRACTION = 20e-6, 1e-3, 0.05  # then sleeps: this fraction of the time waited
_CACHED_LAYOUTS = 256  # descriptors (send side) and pull plans (receive side) kept per layout

@dataclasses.dataclass
class _PendingPull:
    """A receive in progress; kept across a timeout so a retry resumes it."""

    descriptor: jax.Array
    data: list[jax.Array] | None = None  # pulled arrays, sorted by name
    data_plan: PullPlan | None = None  # the plan ``data`` were pulled with


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
        self._descriptors: collections.OrderedDict[tuple, jax.Array] = collections.OrderedDict()  # send side
        self._plans: collections.OrderedDict[tuple, PullPlan] = collections.OrderedDict()  # receive side
        self._descriptor_structs: collections.OrderedDict[tuple, jax.ShapeDtypeStruct] = collections.OrderedDict()
        # seconds the latest receive waited for the descriptor, then for the data (for profiling)
        self.last_receive_waits: tuple[float, float] = (0.0, 0.0)
        self.readiness_checks = 0  # is_ready() calls so far (each leaks a little native memory in jaxlib 0.10.2)
        self._aborted = False  # set by abort_receives(): every receive fails until connect_previous()

    def connect_previous(self, address: str, peer_name: str = "previous stage") -> None:
        """Connect to the previous stage's ``address``; ``receive`` pulls from it. Connecting again (a replaced
        previous stage) drops the pulls still pending from the old one."""
        self._conn = self._server.connect(address)
        self.peer = f"{peer_name} at {address}"
        with self._lock:
            self._plans.clear()  # learned from the old peer's descriptors
            self._pending.clear()
            self._aborted = False

    def abort_receives(self) -> None:
        self._aborted = True

    # -- sending ------------------------------------------------------------------------------

    def send(self, step_id: int, tensors: IntermediateTensors) -> None:
        _check_step_id(step_id)
        arrays = [v if isinstance(v, jax.Array) else jax.device_put(v) for v in tensors.values()]
        key = tuple((name, a.shape, a.dtype, a.sharding) for name, a in zip(tensors, arrays, strict=True))
        encoded = self._descriptors.get(key)
        if encoded is None:  # a layout not sent before: describe it once
            for name, array in zip(tensors, arrays, strict=True):
                if not array.is_fully_addressable:
                    raise ValueError(f"step {step_id}: {name!r} spans processes; a stage must live in one process")
            described = {k: describe_array(a) for k, a in zip(tensors, arrays, strict=True)}
            descriptor = {"pipejax": 1, "tensors": described}
            home = arrays[0].addressable_shards[0].device if arrays else jax.local_devices()[0]
            encoded = jax.device_put(encode(descriptor), home)
            with self._lock:
                _cache(self._descriptors, key, encoded)
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
        if self._aborted:
            raise TransportAborted(f"step {step_id}: receives from {self.peer} are aborted until it is replaced")
        deadline = time.monotonic() + timeout
        key = spec_key(spec)
        with self._lock:
            if step_id in self._received:
                raise ValueError(f"step {step_id} was already received from {self.peer}; each step is pulled once")
            pending = self._pending.get(step_id) or self._start_pull(step_id, key, spec)

        descriptor_wait = self._wait([pending.descriptor], step_id, timeout, deadline)
        raw = np.asarray(pending.descriptor).tobytes()
        misplaced = False
        plan = pending.data_plan
        if plan is None or plan.key != key or plan.descriptor != raw:
            try:
                plan = make_plan(key, raw, spec, step_id, self.peer)
                with self._lock:
                    _cache(self._plans, key, plan)  # the sender's layout now, for the next steps
                if pending.data is not None:
                    misplaced = check_misguessed(pending.data_plan, plan, step_id, self.peer)
            except ValueError:
                with self._lock:
                    self._pending.pop(step_id, None)
                raise
            if pending.data is None:
                pending.data = self._conn.pull(2 * step_id + 1, list(plan.structs))
                pending.data_plan = plan
        self.last_receive_waits = (descriptor_wait, self._wait(pending.data, step_id, timeout, deadline))

        with self._lock:
            del self._pending[step_id]
            _remember(self._received, step_id)
        out = {}
        for i, (name, array) in enumerate(zip(spec.names(), pending.data, strict=True)):
            target = spec.tensors[name].sharding
            if misplaced:
                array = reassemble(array, pending.data_plan.shardings[i], plan.entries[i], target or plan.shardings[i])
            elif target is not None and target is not plan.shardings[i] and target != plan.shardings[i]:
                array = jax.device_put(array, target)
            out[name] = array
        return IntermediateTensors(out)

    def prefetch(self, step_id: int, spec: IntermediateSpec) -> None:
        with self._lock:
            if self._conn is None or self._aborted or step_id in self._received or step_id in self._pending:
                return
            self._start_pull(step_id, spec_key(spec), spec)

    def _start_pull(self, step_id: int, key: tuple, spec: IntermediateSpec) -> _PendingPull:
        """Issue ``step_id``'s pulls (under ``_lock``). With a plan from an earlier step of this spec, the data pull
        goes out now, next to the descriptor's, in that plan's layout; the descriptor then confirms it."""
        plan = self._plans.get(key)
        data = self._conn.pull(2 * step_id + 1, list(plan.structs)) if plan is not None else None
        struct = self._descriptor_structs.get(key)
        if struct is None:
            home = SingleDeviceSharding(_home_device(spec))
            struct = jax.ShapeDtypeStruct((DESCRIPTOR_BYTES,), np.uint8, sharding=home)
            _cache(self._descriptor_structs, key, struct)
        pending = self._pending[step_id] = _PendingPull(self._conn.pull(2 * step_id, [struct])[0], data, plan)
        return pending

    def _wait(self, arrays: list[jax.Array], step_id: int, timeout: float, deadline: float) -> float:
        """Seconds until ``arrays`` landed."""
        # Polled, not blocked on in a helper thread: a thread left inside block_until_ready on a
        # pull that never completes aborts the interpreter at exit ("FATAL: exception not rethrown").
        # A sleep here lasts ~80 us whatever it asks for, longer than a decode-size pull takes to
        # land once it is under way: so first spin (yielding the core) for _SPIN_S, then sleep a
        # fraction of the time waited so far, so a long transfer is noticed within a few % of it.
        # Readiness is queried at most every _SPIN_CHECK_S while spinning: each query leaks.
        start = time.monotonic()
        while not self._ready(arrays):
            if self._aborted:
                with self._lock:
                    self._pending.pop(step_id, None)
                raise TransportAborted(f"step {step_id}: the receive from {self.peer} was aborted (it is replaced)")
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise TransportTimeout(
                    f"step {step_id}: no activations from {self.peer} after {timeout:.1f}s; "
                    f"is the previous stage running and using the same step ids?"
                )
            waited = now - start
            if waited < _SPIN_S:
                until = now + _SPIN_CHECK_S
                while time.monotonic() < until:
                    os.sched_yield()
            else:
                time.sleep(min(max(_POLL_MIN_S, min(_POLL_MAX_S, _POLL_FRACTION * waited)), left))
        try:
            jax.block_until_ready(arrays)  # ready by now; raises if the pull failed
        except jax.errors.JaxRuntimeError as e:
            with self._lock:
                self._pending.pop(step_id, None)
            raise ConnectionError(
                f"step {step_id}: pulling activations from {self.peer} failed ({e}); did that stage's process exit?"
            ) from e
        return time.monotonic() - start

    def _ready(self, arrays: list[jax.Array]) -> bool:
        for array in arrays:
            self.readiness_checks += 1
            if not array.is_ready():
                return False
        return True

    def pending(self) -> int:
        """Receives that timed out and can be resumed."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._conn = None
        self._pending.clear()
        self._plans.clear()


def _cache(cache: collections.OrderedDict, key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > _CACHED_LAYOUTS:
        cache.popitem(last=False)


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
            return devices_of(s.sharding)[0]
    return jax.local_devices()[0]
