"""Ray Compiled Graph mode: the stage actors chained in a compiled graph that carries only small
control messages, over zmq edges whose readers sleep (``graph_channel``; Ray's shared-memory channel on request).

Activations do not ride the graph: every stage moves them through the very same PP transport
(its JAX transfer server, keyed by step id) that the plain mode uses — one PP communicator for
every mode. A stage posts its activations before it emits its control message; a stage that
fails emits ``ok=False`` so the next one never blocks on a pull that cannot come.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ray.dag import DAGContext, InputNode

from pipejax.ray_executor.executor.graph_channel import WaitingChannelType

CONTROL_BUFFER_BYTES = 8 << 20  # sized up front: a channel that grows at run time can hang teardown
TEARDOWN_TIMEOUT_S = 30


@dataclasses.dataclass(frozen=True)
class StepControl:
    """What flows stage to stage in the graph: the batch (token ids, block tables — control data),
    and whether the sender succeeded. The activations went through the transport."""

    batch: Any
    ok: bool = True
    error: str | None = None


class CompiledPipeline:
    """Compiles ``stage 0 -> ... -> last`` once; ``submit(batch)`` returns a future of the last stage's output."""

    def __init__(self, actors: list, max_inflight: int, get_timeout_s: float,
                 describe_error: Callable[[Exception], Exception] | None = None, channel: str = "zmq"):
        """``describe_error`` turns a Ray error of a step (a dead actor, a channel timeout) into the error
        the engine reports (the executor names the stage and its host). ``channel``: the edges' channel,
        ``"zmq"`` (readers sleep until a message comes: ``graph_channel``) or ``"shared_memory"`` (Ray's own,
        whose readers spin; ``RayConfig.graph_channel`` checks the name)."""
        context = DAGContext.get_current()
        # A step may include a first-time JIT compile; the defaults (10 s) are for microsecond graphs.
        context.get_timeout = int(get_timeout_s)
        context.submit_timeout = int(get_timeout_s)
        context.read_iteration_timeout = int(get_timeout_s)
        context.teardown_timeout = TEARDOWN_TIMEOUT_S
        # A chain: every stage reads its predecessor's control message (stage 0 the driver's batch). Every stage
        # after the first also reads the batch from the driver, to start pulling its activations before that
        # message comes (as plain mode's prefetch calls do).
        with InputNode() as batch:
            if channel == "zmq":  # the batch reaches stage 0 first: the others only start pulls with it
                batch.type_hint = WaitingChannelType(first_reader=actors[0])
            node = batch
            for rank, actor in enumerate(actors):
                node = actor.execute_step.bind(node, *([actor.prefetch_step.bind(batch)] if rank else []))
                if channel == "zmq":
                    node.type_hint = WaitingChannelType()
        self.graph = node.experimental_compile(
            _max_inflight_executions=max_inflight, _buffer_size_bytes=CONTROL_BUFFER_BYTES
        )
        self.get_timeout_s = get_timeout_s
        self._describe_error = describe_error or (
            lambda exc: RuntimeError(f"compiled graph step failed: {type(exc).__name__}: {exc}"))
        # Results are read in submission order by one thread, so the engine gets ordinary futures.
        self._pending: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read_results, name="pipejax-cgraph-reader", daemon=True)
        self._reader.start()

    def submit(self, batch) -> Future:
        future: Future = Future()
        self._pending.put((self.graph.execute(batch), future))
        return future

    def _read_results(self) -> None:
        while (item := self._pending.get()) is not None:
            ref, future = item
            try:
                value = ref.get(timeout=self.get_timeout_s)
            except Exception as exc:  # a dead actor, a channel timeout: the engine reports it
                future.set_exception(self._describe_error(exc))
                continue
            if isinstance(value, StepControl):  # only failures end as a control message at the driver
                future.set_exception(RuntimeError(value.error))
            else:
                future.set_result(value)

    def teardown(self, kill_actors: bool = True) -> None:
        """Stop the graph; ``kill_actors=False`` keeps the stage actors (replacing a lost one: the others
        serve the next graph)."""
        self._pending.put(None)
        try:
            self.graph.teardown(kill_actors=kill_actors)
        except Exception:  # a dead actor's channels; the executor kills what it must anyway
            pass


def execute_step(actor, incoming, name: str):
    """A stage's node in the graph: run the step unless an earlier stage failed.

    ``incoming`` is the batch (stage 0, from the driver) or the previous stage's ``StepControl``.
    """
    control = incoming if isinstance(incoming, StepControl) else StepControl(incoming)
    if not control.ok:
        return control
    batch = control.batch
    try:
        out = actor.worker.execute_model(batch)
    except Exception as exc:
        return StepControl(batch, False, f"{name} failed on step {batch.step_id}: {type(exc).__name__}: {exc}")
    if actor.worker.stage.is_last:
        return out
    return control

