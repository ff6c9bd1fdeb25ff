"""One data-parallel rank: an ``LLMEngine`` in its own busy loop, fed and drained over ZMQ.

The loop owns the request sockets (a DEALER to every API server's ROUTER, a PUSH to every API
server's PULL); a side thread owns a PUSH to the coordinator and sends the engine's waiting /
running counts every ``STATS_INTERVAL_S`` (the coordinator also takes it as a heartbeat, so a
long compile or step never looks like a dead engine).

The same class runs inside a Ray actor (``EngineCoreActor``, backend ``ray``) and inside a local
process (``run_engine_process``, backend ``mp``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.engine.request import RequestDelta
from pipejax.ray_executor.serving.addresses import DPAddresses
from pipejax.ray_executor.serving.protocol import (
    STATS_INTERVAL_S,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHealth,
    EngineInfo,
    EngineStats,
    Logprob,
    RequestType,
    engine_identity,
)

if TYPE_CHECKING:
    from pipejax.ray_executor.engine.engine import EngineDeadError

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle engine waits for a message before looking at its stop flag
IDLE_CHECK_S = 10.0  # how often an idle engine checks that its stages answer (and heals a lost one)
REVIVE_PAUSE_S = 2.0  # between tries to place lost stages that found no node within the recovery timeout
SEND_LINGER_MS = 5_000  # how long closing sockets may take to flush the last outputs


class EngineCore:
    def __init__(self, config: EngineConfig, index: int, addresses: DPAddresses, warmup: bool = True,
                 node_id: str = "", placement_group=None, on_engine_built: Callable[[], None] | None = None,
                 incarnation: int = 0):
        """``placement_group``: the DP rank's group its stage actors go in (backend ``ray``);
        ``on_engine_built``: called in ``run`` once the engine exists; ``incarnation``: how many times the head
        rebuilt this rank before (its heartbeats say so)."""
        self.config = config
        self.incarnation = incarnation
        self.placement_group = placement_group
        self.index = index
        self.addresses = addresses
        self.warmup = warmup
        self.node_id = node_id or socket.gethostname()
        self.stop_event = threading.Event()
        self.dead: str | None = None
        self.unplaced: str | None = None  # why lost stages wait for a node (``_wait_for_node``); None: whole
        self._reviver: threading.Thread | None = None
        self.engine = None
        self.on_engine_built = on_engine_built
        self._clients: dict[str, int] = {}  # request id -> API server index
        self._warmup_left: list = []  # warm-up batches not yet run (``_warm_up_one``)
        self.proven_at = time.monotonic()  # when the engine last finished a step or found its stages answering
        self._encoder = msgspec.msgpack.Encoder()
        self._decode_add = msgspec.msgpack.Decoder(EngineCoreRequest).decode
        self._decode_abort = msgspec.msgpack.Decoder(list[str]).decode

    # --- life ------------------------------------------------------------------------------------

    def run(self) -> str:
        """Build the engine, announce it, serve until told to stop or the engine dies; returns why it ended."""
        self.engine = self.build_engine()
        if self.warmup:  # compiled while the engine is idle (``_warm_up_one``): it announces itself first
            self._warmup_left = self.engine.executor.warmup_batches()
        if self.on_engine_built is not None:
            self.on_engine_built()
        ctx = zmq.Context()
        dealers, pushes = [], []
        for i in range(self.addresses.api_server_count):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, engine_identity(self.index))
            dealer.setsockopt(zmq.LINGER, SEND_LINGER_MS)
            dealer.connect(self.addresses.input(i))
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, SEND_LINGER_MS)
            push.connect(self.addresses.output(i))
            dealers.append(dealer)
            pushes.append(push)
        self._pushes = pushes
        stats = threading.Thread(target=self._stats_loop, args=(ctx,), name=f"engine{self.index}-stats", daemon=True)
        stats.start()
        info = self._encoder.encode(self.info())
        for dealer in dealers:
            dealer.send_multipart([RequestType.READY.value, info])
        log.info("%s ready", self.info().describe())
        try:
            return self._loop(dealers)
        finally:
            self.stop_event.set()
            stats.join(timeout=2 * STATS_INTERVAL_S + 1)
            if self._reviver is not None:
                self._reviver.join(timeout=1)  # a try under way ends at its own timeout; the engine shuts down
            for s in dealers + pushes:
                s.close()
            ctx.term()
            self.engine.shutdown()

    def build_engine(self):
        from pipejax.ray_executor.engine.engine import LLMEngine

        return LLMEngine(self.config, placement_group=self.placement_group)

    def _warm_up_one(self) -> None:
        """Compile one more common shape, between requests: the engine answers its first request without
        waiting for every bucket, and a request's own new shape compiles when it comes (the runner logs it)."""
        batch = self._warmup_left.pop(0)
        try:
            self.engine.executor.warmup_one(batch)
        except Exception as exc:  # noqa: BLE001 - a stage lost meanwhile: healed (or the engine dies, named)
            self.engine.heal(exc)
        if not self._warmup_left:
            log.info("engine %d: warm-up done (%d step shapes compiled on stage 0)", self.index,
                     self.engine.executor.collective_rpc("num_compiled_shapes")[0])

    def info(self) -> EngineInfo:
        return EngineInfo(
            index=self.index, node_id=self.node_id, host=socket.gethostname(), pid=os.getpid(),
            max_model_len=self.engine.max_model_len, vocab_size=self.engine.model_config.vocab_size,
            kv_cache=self.engine.executor.kv_cache.describe(),
        )

    def _loop(self, dealers: list[zmq.Socket]) -> str:
        from pipejax.ray_executor.engine.engine import EngineDeadError

        poller = zmq.Poller()
        for dealer in dealers:
            poller.register(dealer, zmq.POLLIN)
        while not self.stop_event.is_set():
            busy = self.unplaced is None and self.engine.has_unfinished_requests()
            for sock, _ in poller.poll(0 if busy or self._warmup_left else IDLE_POLL_MS):
                self._drain(sock)
            if self.stop_event.is_set() or self.unplaced is not None:
                continue  # new requests are refused (``_add``) until the reviver places the lost stages
            if not self.engine.has_unfinished_requests():
                try:
                    if self._warmup_left:
                        self._warm_up_one()
                        self.proven_at = time.monotonic()
                    elif time.monotonic() - self.proven_at >= IDLE_CHECK_S:
                        self.engine.check_stages()
                        self.proven_at = time.monotonic()
                except EngineDeadError as exc:
                    if not self._wait_for_node(exc):
                        return self._die(exc)
                continue
            try:
                outputs = self.engine.step_deltas()
            except EngineDeadError as exc:
                if not self._wait_for_node(exc):
                    return self._die(exc)
                continue
            self.proven_at = time.monotonic()
            self._send(outputs)
        return "stopped"

    def health(self) -> EngineHealth:
        """What the stats thread reports besides the load (read from the engine loop's thread: plain fields)."""
        r = self.engine.recovery
        return EngineHealth(time.monotonic() - self.proven_at, self.engine.recovering, r.recoveries,
                            r.requests_moved, r.seconds, self.unplaced or "")

    def _die(self, exc: EngineDeadError) -> str:
        """The executor failed: fail every request with an error naming this engine, say so, stop."""
        self.dead = f"{type(exc).__name__}: {exc}"  # the cause; receivers prefix the engine's name
        log.error("%s died: %s", self.info().describe(), self.dead)
        self._fail_requests(exc, engine_dead=self.dead)
        return self.dead

    def _wait_for_node(self, exc: EngineDeadError) -> bool:
        """Recovery found no node for a lost stage in time (``exc.revivable``): its requests fail (or move to a
        live engine), and the engine stays up, refusing requests, while a thread tries again to place the stage
        (``LLMEngine.revive``); it serves again once that succeeds. False where the engine is dead for good."""
        if not (exc.revivable and self.config.recovery):
            return False
        self.unplaced = f"{type(exc).__name__}: {exc}"
        log.error("%s cannot serve until a node takes its lost stage(s): %s", self.info().describe(), self.unplaced)
        self._fail_requests(exc)
        self._reviver = threading.Thread(target=self._revive, name=f"engine{self.index}-revive", daemon=True)
        self._reviver.start()
        return True

    def _revive(self) -> None:
        while not self.stop_event.is_set():
            if self.engine.revive():
                self.proven_at = time.monotonic()
                self.unplaced = None
                log.warning("%s serves again: its lost stage(s) were placed", self.info().describe())
                return
            self.stop_event.wait(REVIVE_PAUSE_S)

    def _fail_requests(self, exc: EngineDeadError, engine_dead: str | None = None) -> None:
        """Every request of this engine fails with ``exc`` naming the engine (kind "engine_dead": an API server
        moves it to a live engine where there is one); ``engine_dead``: the last message says the engine is gone."""
        prefix = f"{self.info().describe()} died: "
        failed = [d for d in exc.failed_deltas if d.request_id in self._clients]
        self._send(failed, error_kind="engine_dead", error_prefix=prefix)
        # Requests the engine no longer knew about fail too.
        leftovers = dict(self._clients)
        self._clients.clear()
        message = f"{prefix}{type(exc).__name__}: {exc}"
        for client in range(len(self._pushes)):
            mine = [EngineCoreOutput(rid, finish_reason="error", error=message, error_kind="engine_dead")
                    for rid, c in leftovers.items() if c == client]
            if mine or engine_dead:
                self._push(client, EngineCoreOutputs(self.index, mine, engine_dead=engine_dead))

    # --- messages in -----------------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.error("engine %d: a message of %d frames ignored", self.index, len(frames))
                continue
            kind, payload = frames
            try:
                if kind == RequestType.ADD.value:
                    self._add(self._decode_add(payload))
                elif kind == RequestType.ABORT.value:
                    for rid in self._decode_abort(payload):
                        self._forget(rid)
                        self.engine.abort_request(rid)
                elif kind == RequestType.SHUTDOWN.value:
                    self.stop_event.set()
                else:
                    log.warning("engine %d: unknown request type %r ignored", self.index, kind)
            except msgspec.DecodeError as exc:  # a bad message must not take the engine down
                log.error("engine %d: undecodable %r message ignored: %s", self.index, kind, exc)

    def _add(self, req: EngineCoreRequest) -> None:
        if self.unplaced is not None:
            error = (f"{self.info().describe()} cannot take requests while a lost stage waits for a node "
                     f"({self.unplaced}); it serves again once a host with the resources joins")
            out = EngineCoreOutput(req.request_id, finish_reason="error", error=error, error_kind="unavailable")
            self._push(req.client_index, EngineCoreOutputs(self.index, [out]))
            return
        try:
            self.engine.add_request(req.request_id, {"prompt_token_ids": req.prompt_token_ids}, req.sampling_params,
                                    req.resume_token_ids)
        except ValueError as exc:
            out = EngineCoreOutput(req.request_id, finish_reason="error", error=str(exc), error_kind="invalid_request")
            self._push(req.client_index, EngineCoreOutputs(self.index, [out]))
            return
        self._clients[req.request_id] = req.client_index

    def _forget(self, rid: str) -> None:
        self._clients.pop(rid, None)

    # --- messages out ----------------------------------------------------------------------------

    def _send(self, deltas: list[RequestDelta], error_kind: str | None = None, error_prefix: str = "") -> None:
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for out in deltas:
            client = self._clients.get(out.request_id)
            if client is None:  # aborted: nobody is listening
                continue
            by_client.setdefault(client, []).append(_wire(out, error_kind, error_prefix))
            if out.finished:
                self._forget(out.request_id)
        for client, outs in by_client.items():
            self._push(client, EngineCoreOutputs(self.index, outs))

    def _push(self, client: int, outputs: EngineCoreOutputs) -> None:
        """Never block the loop on one API server: one that stopped reading loses its requests, not the engine."""
        if client >= len(self._pushes):
            log.warning("engine %d: no API server %d; outputs dropped", self.index, client)
            return
        try:
            self._pushes[client].send(self._encoder.encode(outputs), zmq.NOBLOCK)
        except zmq.Again:
            gone = [rid for rid, c in self._clients.items() if c == client]
            log.error("engine %d: API server %d is not reading its outputs; aborting its %d requests",
                      self.index, client, len(gone))
            for rid in gone:
                self._forget(rid)
                self.engine.abort_request(rid)

    def _stats_loop(self, ctx: zmq.Context) -> None:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 100)  # a stale heartbeat is worthless: drop rather than queue
        push.connect(self.addresses.stats)
        try:
            while True:
                sched = self.engine.scheduler
                stats = EngineStats(self.index, len(sched.waiting), len(sched.running), self.dead, self.health(),
                                    self.incarnation)
                try:
                    push.send(self._encoder.encode(stats), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if self.stop_event.wait(STATS_INTERVAL_S):
                    return
        finally:
            push.close()


class EngineCoreActor:
    """The Ray actor body of one DP rank; ``stop`` runs in its own concurrency group while ``run`` loops."""

    def __init__(self, config: EngineConfig, index: int, addresses: DPAddresses, warmup: bool = True,
                 placement_group=None, incarnation: int = 0):
        import ray

        logging.basicConfig(level=logging.INFO)
        node_id = ray.get_runtime_context().get_node_id()
        self.core = EngineCore(config, index, addresses, warmup, node_id=node_id, placement_group=placement_group,
                               incarnation=incarnation)

    def run(self) -> str:
        return self.core.run()

    def stop(self) -> None:
        self.core.stop_event.set()

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pid": os.getpid()}


def run_engine_process(config: EngineConfig, index: int, addresses: DPAddresses, warmup: bool) -> None:
    """Backend ``mp``: the body of a local engine process (``multiprocessing`` spawn target); SIGTERM stops it."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine{index} %(levelname)s %(message)s")

    def stop_on_sigterm() -> None:
        signal.signal(signal.SIGTERM, lambda *_: core.stop_event.set())

    # ray.init (inside the engine's build) installs its own SIGTERM handler, sys.exit from wherever the main
    # thread is, which aborted the process at shutdown (exit code -6): ours goes back once the engine is built.
    core = EngineCore(config, index, addresses, warmup, on_engine_built=stop_on_sigterm)
    # Ctrl-C reaches the whole process group: the launcher decides when engines stop (SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_on_sigterm()
    reason = core.run()
    log.info("engine %d ended: %s", index, reason)
    if core.dead:
        raise SystemExit(3)


def _wire(delta: RequestDelta, error_kind: str | None, error_prefix: str) -> EngineCoreOutput:
    """The engine's delta as the wire's output (an error names the engine through ``error_prefix``)."""
    finish = delta.finish_reason
    logprobs = prompt_logprobs = None
    if delta.new_logprobs is not None:
        logprobs = [Logprob(lp.sampled, [tuple(t) for t in lp.top], lp.rank) for lp in delta.new_logprobs]
    if delta.prompt_logprobs is not None:
        prompt_logprobs = [lp and Logprob(lp.sampled, [tuple(t) for t in lp.top], lp.rank)
                           for lp in delta.prompt_logprobs]
    return EngineCoreOutput(
        request_id=delta.request_id,
        new_token_ids=delta.new_token_ids,
        new_text=delta.new_text,
        text_len=delta.text_len,
        new_logprobs=logprobs,
        finish_reason=finish,
        stop_reason=None if finish == "error" else delta.stop_reason,
        error=f"{error_prefix}{delta.stop_reason}" if finish == "error" else None,
        error_kind=(error_kind or "engine_dead") if finish == "error" else None,
        prompt_logprobs=prompt_logprobs,
    )
