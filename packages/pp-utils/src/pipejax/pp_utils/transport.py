"""Moving activations from one pipeline stage to the next, keyed by step id.

One interface, two implementations:
- ``InProcessTransport``: both stages live in this process; ``receive`` places the arrays
  into the receiving stage's sharding with ``jax.device_put``.
- ``TransferServerTransport`` (``transfer_transport.py``): stages in different processes or
  hosts; the receiver pulls straight from the sender's JAX transfer server.

A receive never waits forever: after ``timeout`` seconds it raises ``TransportTimeout`` naming
the step and the peer.
"""

from __future__ import annotations

import abc
import threading
import time

import jax

from pipejax.pp_utils.intermediate import IntermediateSpec, IntermediateTensors

DEFAULT_RECEIVE_TIMEOUT_S = 120.0


class TransportTimeout(TimeoutError):
    """No activations arrived for a step within the timeout."""


class TransportAborted(ConnectionError):
    """A receive was cut short by ``abort_receives`` (the previous stage is being replaced)."""


class ActivationTransport(abc.ABC):
    """Send activations to the next stage / receive them from the previous one."""

    @abc.abstractmethod
    def send(self, step_id: int, tensors: IntermediateTensors) -> None:
        """Make ``tensors`` available to the next stage under ``step_id``; returns without waiting."""

    @abc.abstractmethod
    def receive(
        self, step_id: int, spec: IntermediateSpec, timeout: float = DEFAULT_RECEIVE_TIMEOUT_S
    ) -> IntermediateTensors:
        """The previous stage's activations for ``step_id``, placed in ``spec``'s shardings."""

    def prefetch(self, step_id: int, spec: IntermediateSpec) -> None:
        """Start pulling ``step_id``'s activations now, from another thread, while this stage still runs an earlier
        step: its ``receive`` then finds them under way or landed. Never raises; a transport that cannot does
        nothing."""

    def abort_receives(self) -> None:
        """Make every receive, waiting now or later, fail with ``TransportAborted`` until ``connect_previous``
        connects again (callable from another thread): the executor is replacing a lost previous stage, whose
        activations will never come."""

    def close(self) -> None:
        """Release sockets/servers; idempotent."""


def place(tensors: IntermediateTensors, spec: IntermediateSpec) -> IntermediateTensors:
    """``jax.device_put`` every array into the sharding ``spec`` names for it."""
    return IntermediateTensors(
        {k: jax.device_put(v, spec.tensors[k].sharding) if spec.tensors[k].sharding else v for k, v in tensors.items()}
    )


class InProcessTransport(ActivationTransport):
    """A mailbox shared by two stages in one process (the sender's and receiver's ends are one object)."""

    def __init__(self, peer: str = "previous stage"):
        self.peer = peer
        self._boxes: dict[int, IntermediateTensors] = {}
        self._cond = threading.Condition()

    def send(self, step_id: int, tensors: IntermediateTensors) -> None:
        with self._cond:
            if step_id in self._boxes:
                raise ValueError(f"step {step_id} was already sent to {self.peer}; step ids must be unique")
            self._boxes[step_id] = tensors
            self._cond.notify_all()

    def receive(
        self, step_id: int, spec: IntermediateSpec, timeout: float = DEFAULT_RECEIVE_TIMEOUT_S
    ) -> IntermediateTensors:
        deadline = time.monotonic() + timeout
        with self._cond:
            while step_id not in self._boxes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        f"step {step_id}: no activations from {self.peer} after {timeout:.1f}s; "
                        f"is the previous stage running and using the same step ids?"
                    )
                self._cond.wait(left)
            tensors = self._boxes.pop(step_id)
        spec.check(tensors, step_id=step_id, peer=self.peer)
        return place(tensors, spec)

    def pending(self) -> int:
        with self._cond:
            return len(self._boxes)

    def close(self) -> None:
        """Drop activations that were sent but never received (e.g. after a failed step)."""
        with self._cond:
            self._boxes.clear()
