"""The DP coordinator: collects every engine's waiting/running counts and publishes them to every API server.

It runs as a thread of the head's launcher process. Engines PUSH ``EngineStats`` every
``STATS_INTERVAL_S`` (which is also their heartbeat); the coordinator PUBlishes a ``LoadUpdate``
when the counts change (at most every ``PUBLISH_MIN_S``) and at least every ``PUBLISH_MAX_S``, so an
API server that subscribed late catches up. Engines are declared dead by the launcher (their
actor/process ended), by themselves (``EngineStats.dead``), or by a heartbeat silent for
``heartbeat_timeout_s``; a dead engine stays dead.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from pipejax.ray_executor.serving.addresses import DPAddresses
from pipejax.ray_executor.serving.protocol import EngineHealth, EngineStats, LoadUpdate

log = logging.getLogger(__name__)

PUBLISH_MIN_S = 0.05
PUBLISH_MAX_S = 1.0
POLL_MS = 50


class DPCoordinator:
    def __init__(self, addresses: DPAddresses, dp_size: int, heartbeat_timeout_s: float = 15.0):
        self.addresses = addresses
        self.dp_size = dp_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.counts = [[0, 0] for _ in range(dp_size)]
        self.dead: dict[int, str] = {}
        self.health: dict[int, EngineHealth] = {}
        self.incarnation = [0] * dp_size  # the engine expected per rank (``expect``)
        self._last_seen: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dp-coordinator", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        if not self._bound.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the DP coordinator could not bind {self.addresses.stats} / "
                               f"{self.addresses.publish}: {self._error}")

    def mark_dead(self, index: int, reason: str) -> None:
        with self._lock:
            if index not in self.dead:
                log.error("data-parallel engine %d died: %s", index, reason)
                self.dead[index] = reason

    def expect(self, index: int, incarnation: int) -> None:
        """Engine ``index`` is being rebuilt as ``incarnation``: it stays dead (the API servers have moved its
        requests) until that incarnation's first heartbeat; stats of older ones are ignored."""
        with self._lock:
            self.incarnation[index] = incarnation

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context()
        pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        for s in (pull, pub):
            s.setsockopt(zmq.LINGER, 0)
        try:
            pull.bind(self.addresses.stats)
            pub.bind(self.addresses.publish)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        decode = msgspec.msgpack.Decoder(EngineStats).decode
        encode = msgspec.msgpack.Encoder().encode
        published, last_publish = None, 0.0
        try:
            while not self._stop.is_set():
                if pull.poll(POLL_MS):
                    while True:
                        try:
                            stats = decode(pull.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        self._record(stats)
                self._check_heartbeats()
                with self._lock:
                    update = LoadUpdate([list(c) for c in self.counts], dict(self.dead), dict(self.health))
                now = time.monotonic()
                changed = update != published
                if (changed and now - last_publish >= PUBLISH_MIN_S) or now - last_publish >= PUBLISH_MAX_S:
                    pub.send(encode(update))
                    published, last_publish = update, now
        finally:
            pull.close()
            pub.close()
            ctx.term()

    def _record(self, stats: EngineStats) -> None:
        if not 0 <= stats.engine_index < self.dp_size:
            log.warning("stats from unknown engine %d ignored", stats.engine_index)
            return
        index = stats.engine_index
        with self._lock:
            if stats.incarnation < self.incarnation[index]:
                return  # a replaced engine's last words
            if index in self.dead and stats.incarnation > 0 and not stats.dead:
                log.warning("data-parallel engine %d is back (rebuilt, incarnation %d)", index, stats.incarnation)
                self.dead.pop(index)
            self._last_seen[index] = time.monotonic()
            self.counts[index] = [stats.waiting, stats.running]
            if stats.health is not None:
                self.health[index] = stats.health
        if stats.dead:
            self.mark_dead(stats.engine_index, stats.dead)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for index, seen in list(self._last_seen.items()):
            if index not in self.dead and now - seen > self.heartbeat_timeout_s:
                self.mark_dead(index, f"no heartbeat for {self.heartbeat_timeout_s:.0f}s; its process or host is gone")
