"""An API server's side of the DP engines: its own sockets to every engine, load-aware routing, per-request streams.

Each API server binds a ROUTER (requests out, engines' READY in) and a PULL (outputs in), and
subscribes to the coordinator's load updates. A request goes to the engine it names, or to the
one with the least load (``4 x waiting + running``, the coordinator's counts plus what this
server sent since the last update; ties broken round-robin). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from pipejax.ray_executor.serving.addresses import DPAddresses
from pipejax.ray_executor.serving.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHealth,
    EngineInfo,
    LoadUpdate,
    RequestType,
    engine_identity,
    engine_index,
)
from pipejax.runner.batch import SamplingParams

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request the engines could not serve; ``kind`` says whose fault (and so the HTTP status)."""

    STATUS = {"invalid_request": 400, "engine_dead": 500, "unavailable": 503, "timeout": 504}

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind

    @property
    def status(self) -> int:
        return self.STATUS.get(self.kind, 500)


class DPClient:
    def __init__(self, addresses: DPAddresses, client_index: int, dp_size: int, output_timeout_s: float = 600.0):
        self.addresses = addresses
        self.client_index = client_index
        self.dp_size = dp_size
        self.output_timeout_s = output_timeout_s
        self.engines: dict[int, EngineInfo] = {}  # engines that announced themselves
        self.dead: dict[int, str] = {}
        self.counts = [[0, 0] for _ in range(dp_size)]  # [waiting, running] per engine, as last known
        self.health: dict[int, EngineHealth] = {}  # per engine, as last known (the coordinator's)
        self.migrate = True  # a request whose engine died goes on on a live one (``generate``)
        self._announced_after_death: set[int] = set()  # dead engines whose rebuilt successor said READY
        self.on_migrated: Callable[[int, int], None] | None = None  # (from engine, to engine), for metrics
        self.routed = [0] * dp_size  # requests this server sent to each engine (tests, metrics)
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}
        self._round_robin = itertools.count()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        self._decode_info = msgspec.msgpack.Decoder(EngineInfo).decode
        self._decode_load = msgspec.msgpack.Decoder(LoadUpdate).decode
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    # --- life ------------------------------------------------------------------------------------

    async def start(self, ready_timeout_s: float, should_exit=lambda: False) -> None:
        """Bind, subscribe, and wait until every engine is ready (or raise naming the ones that are not)."""
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an engine that is not connected raises
        self.output = self.ctx.socket(zmq.PULL)
        self.load = self.ctx.socket(zmq.SUB)
        for s in (self.input, self.output, self.load):
            s.setsockopt(zmq.LINGER, 0)
        self.input.bind(self.addresses.input(self.client_index))
        self.output.bind(self.addresses.output(self.client_index))
        self.load.setsockopt(zmq.SUBSCRIBE, b"")
        self.load.connect(self.addresses.publish)
        self._tasks = [asyncio.create_task(c) for c in (self._input_loop(), self._output_loop(), self._load_loop())]
        deadline = time.monotonic() + ready_timeout_s
        while len(self.engines) + len(set(self.dead) - set(self.engines)) < self.dp_size:
            if self.dead:
                raise RuntimeError("; ".join(self.dead.values()))
            if should_exit():
                raise RuntimeError("stopped while waiting for the data-parallel engines")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.dp_size)) - set(self.engines))
                listen = self.addresses.input(self.client_index)
                raise RuntimeError(f"data-parallel engines {missing} were not ready within {ready_timeout_s:.0f}s "
                                   f"(API server {self.client_index} listens on {listen})")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass
        if self.dead:
            raise RuntimeError("; ".join(self.dead.values()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in (self.input, self.output, self.load):
            s.close()
        self.ctx.term()

    def describe(self, index: int) -> str:
        info = self.engines.get(index)
        return info.describe() if info else f"data-parallel engine {index}"

    @property
    def max_model_len(self) -> int:
        return min(i.max_model_len for i in self.engines.values())

    @property
    def vocab_size(self) -> int:
        return min(i.vocab_size for i in self.engines.values())

    # --- routing and requests --------------------------------------------------------------------

    def choose_engine(self, rank: int | None = None, requests: int = 1, exclude: set[int] = frozenset()) -> int:
        if rank is not None:
            if not 0 <= rank < self.dp_size:
                raise RequestFailed(f"data_parallel_rank={rank} is out of range; this server has "
                                    f"data-parallel ranks 0..{self.dp_size - 1}", "invalid_request")
            if rank in self.dead or self.unplaced(rank):
                raise RequestFailed(f"data_parallel_rank={rank}: {self.dead.get(rank) or self.unplaced(rank)}",
                                    "unavailable")
            best = rank
        else:
            alive = [e for e in sorted(self.engines) if e not in self.dead and e not in exclude
                     and not self.unplaced(e)]
            if not alive:
                why = [*self.dead.values(), *filter(None, map(self.unplaced, range(self.dp_size)))]
                raise RequestFailed("no data-parallel engine can serve: " + "; ".join(why), "unavailable")
            start = next(self._round_robin) % len(alive)
            order = alive[start:] + alive[:start]
            best = min(order, key=lambda e: 4 * self.counts[e][0] + self.counts[e][1])
        self.counts[best][0] += requests  # until the coordinator's next update says otherwise
        self.routed[best] += requests
        return best

    def unplaced(self, index: int) -> str:
        """Why engine ``index`` takes no requests while its lost stages wait for a node; "" when it serves."""
        h = self.health.get(index)
        return f"{self.describe(index)} waits for a node for a lost stage: {h.unplaced}" if h and h.unplaced else ""

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, engine: int
    ) -> AsyncIterator[EngineCoreOutput]:
        """Outputs of one (n = 1) request on ``engine`` until it finishes; leaving early aborts it. If that engine
        dies, the request goes on on a live one (``migrate``): sent again with the tokens it has, which that
        engine prefills with the prompt and does not send again; so the caller sees one unbroken stream."""
        received: list[int] = []
        while True:
            try:
                async with contextlib.aclosing(self._attempt(request_id, prompt_token_ids, params, engine,
                                                             received)) as attempt:
                    async for item in attempt:
                        received += item.new_token_ids
                        yield item
                return
            except RequestFailed as exc:
                if exc.kind != "engine_dead" or not self.migrate:
                    raise
                try:
                    to = self.choose_engine(exclude={engine})
                except RequestFailed:
                    raise exc from None  # no live engine left: the original error
                log.warning("API server %d: request %s moves from %s to %s after %d tokens (%s)", self.client_index,
                            request_id, self.describe(engine), self.describe(to), len(received), exc)
                if self.on_migrated is not None:
                    self.on_migrated(engine, to)
                engine = to

    async def _attempt(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, engine: int, resume: list[int]
    ) -> AsyncIterator[EngineCoreOutput]:
        """The request on ``engine`` (going on after ``resume``, its tokens so far) until it finishes."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (queue, engine)
        request = EngineCoreRequest(request_id, prompt_token_ids, params, self.client_index, time.time(),
                                    list(resume))
        finished = False
        try:
            if engine in self.dead:  # it died between routing and now
                raise RequestFailed(self.dead[engine], "engine_dead")
            try:
                await self.input.send_multipart([engine_identity(engine), RequestType.ADD.value, self._encode(request)])
            except zmq.ZMQError as exc:
                raise RequestFailed(f"{self.describe(engine)} is not reachable: {exc}", "unavailable") from None
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=self.output_timeout_s)
                except TimeoutError:
                    raise RequestFailed(f"{self.describe(engine)} sent nothing for request {request_id} within "
                                        f"{self.output_timeout_s:.0f}s", "timeout") from None
                if isinstance(item, RequestFailed):
                    finished = True
                    raise item
                if item.finish_reason == "error":
                    finished = True
                    raise RequestFailed(item.error or "the engine failed the request", item.error_kind or "engine_dead")
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id, (None,))[0] is queue:
                self._streams.pop(request_id, None)
            if not finished and engine not in self.dead:
                self._abort(engine, [request_id])

    def _abort(self, engine: int, request_ids: list[str]) -> None:
        frames = [engine_identity(engine), RequestType.ABORT.value, self._encode(request_ids)]
        try:
            self.input.send_multipart(frames, flags=zmq.NOBLOCK).add_done_callback(_ignore_result)
        except zmq.ZMQError as exc:
            log.warning("could not abort %s on engine %d: %s", request_ids, engine, exc)

    def _engine_died(self, index: int, cause: str) -> None:
        if index in self.dead:
            return
        message = f"{self.describe(index)} died: {cause}"
        self.dead[index] = message
        log.error("%s", message)
        failure = RequestFailed(message, "engine_dead")
        for queue, engine in list(self._streams.values()):
            if engine == index:
                queue.put_nowait(failure)
        self._changed.set()

    # --- socket loops (a bad message is logged and skipped: a loop that died would hang every request) ---

    async def _input_loop(self) -> None:
        while True:
            frames = await self.input.recv_multipart()
            try:
                identity, kind, payload = frames
                if kind == RequestType.READY.value:
                    info = self._decode_info(payload)
                    if info.index != engine_index(identity) or not 0 <= info.index < self.dp_size:
                        raise ValueError(f"READY from identity {identity!r} claims engine {info.index}")
                    self.engines[info.index] = info
                    if info.index in self.dead:  # rebuilt by the head: routed to once the coordinator agrees
                        self._announced_after_death.add(info.index)
                    log.info("API server %d: %s ready; %s", self.client_index, info.describe(), info.kv_cache)
                    self._changed.set()
            except (ValueError, msgspec.DecodeError) as exc:
                log.error("API server %d: bad message from an engine ignored: %s", self.client_index, exc)

    async def _output_loop(self) -> None:
        while True:
            raw = await self.output.recv()
            try:
                msg = self._decode_outputs(raw)
            except msgspec.DecodeError as exc:
                log.error("API server %d: undecodable engine output ignored: %s", self.client_index, exc)
                continue
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream[0].put_nowait(out)
            if msg.engine_dead:
                self._engine_died(msg.engine_index, msg.engine_dead)

    async def _load_loop(self) -> None:
        while True:
            raw = await self.load.recv()
            try:
                update = self._decode_load(raw)
            except msgspec.DecodeError as exc:
                log.error("API server %d: undecodable load update ignored: %s", self.client_index, exc)
                continue
            for index, reason in update.dead.items():
                self._engine_died(index, reason)
            for index in self._announced_after_death - set(update.dead):
                self._announced_after_death.discard(index)
                self.dead.pop(index, None)
                log.warning("API server %d: %s rejoined", self.client_index, self.describe(index))
                self._changed.set()
            if len(update.counts) == self.dp_size:
                self.counts = [list(c) for c in update.counts]
            self.health = dict(update.health)


def _ignore_result(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("abort not sent: %s", future.exception())
