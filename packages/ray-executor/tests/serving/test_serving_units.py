"""The serving pieces without a model: wire types, the engine-core loop (on a fake engine), the coordinator, routing."""

import contextlib
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from pipejax.ray_executor.engine.engine import EngineDeadError, RecoveryStats
from pipejax.ray_executor.engine.request import RequestDelta
from pipejax.ray_executor.serving.addresses import DPAddresses
from pipejax.ray_executor.serving.client import DPClient, RequestFailed
from pipejax.ray_executor.serving.coordinator import DPCoordinator
from pipejax.ray_executor.serving.engine_core import EngineCore
from pipejax.ray_executor.serving.frontend import Choice
from pipejax.ray_executor.serving.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    LoadUpdate,
    RequestType,
    engine_identity,
)
from pipejax.runner.batch import SamplingParams, TokenLogprobs

pytestmark = pytest.mark.timeout(60)

encode = msgspec.msgpack.Encoder().encode


def test_wire_types_round_trip_through_msgspec_and_validate():
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=3, logprobs=2), 1, 9.5)
    assert msgspec.msgpack.decode(encode(req), type=EngineCoreRequest) == req
    bad = encode(EngineCoreRequest("r2", [1], SamplingParams()))
    bad = bad.replace(encode(1.0), encode(-1.0), 1)  # temperature -1 on the wire
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=EngineCoreRequest)
    assert RequestType.ADD.value == b"\x00" and len({t.value for t in RequestType}) == len(RequestType)


def test_fixed_port_layout_is_the_same_on_every_node():
    a = DPAddresses.create("10.0.0.5", 30000, api_server_count=2)
    assert (a.stats, a.publish) == ("tcp://10.0.0.5:30000", "tcp://10.0.0.5:30001")
    assert [a.input(0), a.output(0), a.input(1), a.output(1)] == [f"tcp://10.0.0.5:{p}" for p in range(30002, 30006)]
    assert a == DPAddresses.create("10.0.0.5", 30000, api_server_count=2)
    local = DPAddresses.create(None, None, 1)
    assert local.host == "127.0.0.1" and len({local.stats_port, local.publish_port, *local.input_ports}) == 3


class FakeEngine:
    """Just enough of LLMEngine: one token per step per request, text = letters; request 'cut' stops on "b"."""

    def __init__(self):
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.max_model_len = 64
        self.model_config = SimpleNamespace(vocab_size=100)
        self.executor = SimpleNamespace(kv_cache=SimpleNamespace(describe=lambda: "KV cache: 9 blocks"))
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.sent: dict[str, tuple[int, int]] = {}  # request id -> tokens, characters in earlier deltas
        self.aborted: list[str] = []
        self.fail_next = False
        self.recovery = RecoveryStats(recoveries=1, requests_moved=3, seconds=2.5)
        self.recovering = False
        self.stage_checks = 0  # check_stages() calls: an idle engine proves its stages answer

    def check_stages(self):
        self.stage_checks += 1

    def add_request(self, rid, prompt, params, resume_token_ids=()):
        if not prompt["prompt_token_ids"]:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        self.requests[rid] = (prompt["prompt_token_ids"], params, [])
        self.scheduler.running.append(rid)

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.requests.pop(rid, None)
        if rid in self.scheduler.running:
            self.scheduler.running.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step_deltas(self):
        time.sleep(0.01)
        if self.fail_next:
            failed = [self._delta(rid, "error", "stage 1 (host h) failed") for rid in self.requests]
            err = EngineDeadError("stage 1 (host h) failed on a step: boom", failed_deltas=failed)
            self.requests.clear()
            raise err
        outs = []
        for rid, (_, params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            reason = "length" if len(tokens) >= params.max_tokens else None
            if rid == "cut" and len(tokens) == 3:
                reason = "stop"
            outs.append(self._delta(rid, reason))
            if reason:
                del self.requests[rid]
                self.scheduler.running.remove(rid)
        return outs

    def _delta(self, rid, reason, stop_reason=None):
        tokens = self.requests[rid][2]
        text = "".join("abcdef"[t % 6] for t in tokens)
        if rid == "cut" and reason == "stop":
            text = text[: text.index("b")]  # a stop string cuts text that was already sent
        sent_tokens, sent_chars = self.sent.get(rid, (0, 0))
        self.sent[rid] = (len(tokens), len(text))
        new_logprobs = [TokenLogprobs(-0.5, ((t, -0.5),)) for t in tokens[sent_tokens:]]
        return RequestDelta(rid, tokens[sent_tokens:], text[sent_chars:], len(text), new_logprobs, reason, stop_reason)

    def shutdown(self):
        pass


class FakeCore(EngineCore):
    def build_engine(self):
        return FakeEngine()


def _recv(sock, decode, timeout_ms=5000):
    assert sock.poll(timeout_ms), "nothing arrived"
    return decode(sock.recv())


@contextlib.contextmanager
def running_core(core_class, index: int, warmup: bool, config=None):
    """``core_class``'s loop in a thread, wired to one API server's sockets (ROUTER, PULL) and the stats PULL;
    yields (core, router, pull, stats, result: {"reason": what run() returned}); stops and closes all after."""
    addresses = DPAddresses.create(None, None, 1)
    ctx = zmq.Context()
    router, pull, stats = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    router.bind(addresses.input(0))
    pull.bind(addresses.output(0))
    stats.bind(addresses.stats)
    core = core_class(config, index, addresses, warmup=warmup, node_id="node-x")
    result = {}
    thread = threading.Thread(target=lambda: result.update(reason=core.run()), daemon=True)
    thread.start()
    try:
        yield core, router, pull, stats, result
    finally:
        core.stop_event.set()
        thread.join(timeout=10)
        for s in (router, pull, stats):
            s.close(linger=0)
        ctx.term()


def test_engine_core_loop_streams_deltas_aborts_refuses_and_dies_cleanly():
    decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
    with running_core(FakeCore, 3, warmup=False) as (core, router, pull, stats, result):
        assert router.poll(5000)
        identity, kind, payload = router.recv_multipart()
        info = msgspec.msgpack.decode(payload, type=EngineInfo)
        assert kind == RequestType.READY.value and identity == engine_identity(3) and info.index == 3
        assert "data-parallel engine 3" in info.describe() and info.max_model_len == 64
        assert info.kv_cache == "KV cache: 9 blocks"  # the API server logs it with the engine's ready line

        def send(kind, payload):
            router.send_multipart([engine_identity(3), kind.value, encode(payload)])

        send(RequestType.ADD, EngineCoreRequest("cut", [5, 6], SamplingParams(max_tokens=10, logprobs=1)))
        send(RequestType.ADD, EngineCoreRequest("empty", [], SamplingParams()))
        send(RequestType.ADD, EngineCoreRequest("long", [5], SamplingParams(max_tokens=1000)))
        choice, errors, long_seen = Choice(0, 2), {}, 0
        while choice.finish_reason is None or not errors:
            for out in _recv(pull, decode_outputs).outputs:
                if out.request_id == "cut":
                    choice.apply(out)
                elif out.request_id == "empty":
                    errors[out.request_id] = out
                else:
                    long_seen += 1
        assert errors["empty"].error_kind == "invalid_request" and "prompt is empty" in errors["empty"].error
        assert choice.finish_reason == "stop" and choice.text == "a" and choice.token_ids == [0, 1, 2]
        assert len(choice.logprobs) == 3 and choice.logprobs[0].top == [(0, -0.5)]
        assert long_seen >= 1
        send(RequestType.ABORT, ["long"])
        deadline = time.monotonic() + 5
        while "long" not in core.engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.engine.aborted == ["long"]
        load = _recv(stats, msgspec.msgpack.Decoder(EngineStats).decode)
        assert load.engine_index == 3 and load.dead is None
        h = load.health  # the engine's healing so far and its proof of life ride the heartbeat
        assert (h.recoveries, h.requests_moved, h.recovery_seconds, h.recovering) == (1, 3, 2.5, False)
        assert 0 <= h.proven_age_s < 5

        core.engine.fail_next = True
        send(RequestType.ADD, EngineCoreRequest("doomed", [1], SamplingParams(max_tokens=50)))
        dead, failed = None, []
        while dead is None:
            msg = _recv(pull, decode_outputs)
            failed += [o for o in msg.outputs if o.request_id == "doomed"]
            dead = msg.engine_dead
        deadline = time.monotonic() + 10  # the loop ends by itself once the engine died
        while "reason" not in result and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "EngineDeadError" in dead and "stage 1 (host h)" in dead and result.get("reason") == dead
        assert failed and failed[0].error_kind == "engine_dead"
        assert failed[0].error.startswith("data-parallel engine 3 (host ") and "stage 1 (host h)" in failed[0].error


class UnplacedEngine(FakeEngine):
    """A fake engine whose step fails as a recovery that found no node does, and whose ``revive`` succeeds once
    ``placeable`` is set (a node joined)."""

    def __init__(self):
        super().__init__()
        self.placeable = threading.Event()
        self.revive_tries = 0

    def step_deltas(self):
        if self.fail_next:
            self.fail_next = False
            reason = "recovery failed: RecoveryFailedError: no node could take stage 1"
            failed = [self._delta(rid, "error", reason) for rid in self.requests]
            self.requests.clear()
            raise EngineDeadError(reason, failed_deltas=failed, revivable=True)
        return super().step_deltas()

    def revive(self):
        self.revive_tries += 1
        return self.placeable.wait(0.05)


class UnplacedCore(EngineCore):
    def build_engine(self):
        return UnplacedEngine()


def test_an_engine_whose_lost_stage_finds_no_node_refuses_requests_until_one_joins(monkeypatch):
    """Recovery timed out: the in-flight request fails naming the cause (kind engine_dead: an API server moves it
    to a live engine), the engine does not end, its heartbeat says why it cannot serve, a new request gets
    "unavailable" (503) at once; once revive succeeds the same engine serves again."""
    from pipejax.ray_executor.serving import engine_core

    monkeypatch.setattr(engine_core, "REVIVE_PAUSE_S", 0.05)
    decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
    decode_stats = msgspec.msgpack.Decoder(EngineStats).decode
    with running_core(UnplacedCore, 0, warmup=False, config=SimpleNamespace(recovery=True)) as (
            core, router, pull, stats, result):
        assert router.poll(5000)
        router.recv_multipart()

        def send(rid, max_tokens=4):
            router.send_multipart([engine_identity(0), RequestType.ADD.value,
                                   encode(EngineCoreRequest(rid, [1], SamplingParams(max_tokens=max_tokens)))])

        def outputs_of(rid):
            while True:
                msg = _recv(pull, decode_outputs)
                assert msg.engine_dead is None  # the engine never says it is gone
                mine = [o for o in msg.outputs if o.request_id == rid]
                if mine and mine[-1].finish_reason:
                    return mine[-1]

        core.engine.fail_next = True
        send("in-flight", max_tokens=50)
        failed = outputs_of("in-flight")
        assert failed.error_kind == "engine_dead" and "no node could take stage 1" in failed.error
        send("refused")
        refused = outputs_of("refused")
        assert refused.error_kind == "unavailable" and "waits for a node" in refused.error
        assert "no node could take stage 1" in refused.error
        deadline = time.monotonic() + 5
        while not (h := _recv(stats, decode_stats).health).unplaced and time.monotonic() < deadline:
            pass
        assert "no node could take stage 1" in h.unplaced
        assert core.engine.revive_tries >= 1 and "reason" not in result  # still up, trying

        core.engine.placeable.set()
        while core.unplaced is not None and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        send("served")
        assert outputs_of("served").finish_reason == "length"
        assert not _recv(stats, decode_stats).health.unplaced


def test_routing_and_health_skip_an_engine_waiting_for_a_node():
    from pipejax.ray_executor.serving.frontend import Frontend
    from pipejax.ray_executor.serving.protocol import EngineHealth

    client = DPClient(DPAddresses.create(None, None, 1), 0, dp_size=2)
    client.engines = {i: EngineInfo(i, f"n{i}", "h", 100 + i, 64, 100) for i in range(2)}
    client.health = {0: EngineHealth(0.5), 1: EngineHealth(0.5, unplaced="no node could take stage 1")}
    assert {client.choose_engine() for _ in range(6)} == {0}
    with pytest.raises(RequestFailed, match="waits for a node for a lost stage: no node could take stage 1") as err:
        client.choose_engine(rank=1)
    assert err.value.status == 503
    frontend = SimpleNamespace(client=client, config=SimpleNamespace(client_index=0))
    status, body = Frontend.health(frontend)
    assert (status, body["status"]) == (503, "degraded") and body["engines"][1]["recovering"]
    client.health[0] = EngineHealth(0.5, unplaced="no node could take stage 0")
    with pytest.raises(RequestFailed, match="no data-parallel engine can serve: .*stage 0; .*stage 1"):
        client.choose_engine()
    status, body = Frontend.health(frontend)
    assert (status, body["status"]) == (503, "degraded")  # healing, not dead: the server does not exit


class WarmingEngine(FakeEngine):
    """A fake engine whose executor records the warm-up shapes it compiles, each taking a while."""

    def __init__(self):
        super().__init__()
        self.warmed: list[str] = []
        self.executor.warmup_batches = lambda: [f"shape{i}" for i in range(6)]
        self.executor.warmup_one = lambda batch: (time.sleep(0.2), self.warmed.append(batch))
        self.executor.collective_rpc = lambda name: [len(self.warmed)]


class WarmingCore(EngineCore):
    def build_engine(self):
        return WarmingEngine()


def test_engine_core_announces_itself_first_and_warms_up_between_requests():
    """The engine is READY before any shape compiles; the common shapes compile one by one while it is idle,
    and a request that comes meanwhile is served before the rest."""
    with running_core(WarmingCore, 0, warmup=True) as (core, router, pull, _, _):
        assert router.poll(5000)
        _, kind, _ = router.recv_multipart()
        assert kind == RequestType.READY.value and len(core.engine.warmed) < 6  # ready before the warm-up ends
        router.send_multipart([engine_identity(0), RequestType.ADD.value,
                               encode(EngineCoreRequest("r", [5], SamplingParams(max_tokens=2)))])
        decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        finished_at = None
        while finished_at is None:
            for out in _recv(pull, decode_outputs).outputs:
                if out.finish_reason:
                    finished_at = len(core.engine.warmed)
        assert finished_at < 6  # served between warm-up shapes, not after all of them
        deadline = time.monotonic() + 5
        while len(core.engine.warmed) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.engine.warmed == [f"shape{i}" for i in range(6)]  # each once, in order


def test_coordinator_publishes_load_and_declares_silent_engines_dead():
    addresses = DPAddresses.create(None, None, 1)
    coordinator = DPCoordinator(addresses, dp_size=2, heartbeat_timeout_s=0.5)
    coordinator.start()
    ctx = zmq.Context()
    push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    push.connect(addresses.stats)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(addresses.publish)
    decode = msgspec.msgpack.Decoder(LoadUpdate).decode
    try:
        deadline = time.monotonic() + 5
        update = None
        while time.monotonic() < deadline:
            push.send(encode(EngineStats(0, 3, 1)))
            push.send(encode(EngineStats(1, 0, 2)))
            if sub.poll(100):
                update = decode(sub.recv())
                if update.counts == [[3, 1], [0, 2]]:
                    break
        assert update is not None and update.counts == [[3, 1], [0, 2]] and not update.dead
        deadline = time.monotonic() + 5  # engine 1 falls silent; engine 0 keeps beating
        while time.monotonic() < deadline and 1 not in update.dead:
            push.send(encode(EngineStats(0, 0, 0)))
            if sub.poll(100):
                update = decode(sub.recv())
        assert list(update.dead) == [1] and "no heartbeat" in update.dead[1]
        coordinator.mark_dead(0, "its actor ended")
        while 0 not in update.dead and sub.poll(2000):
            update = decode(sub.recv())
        assert update.dead[0] == "its actor ended"
    finally:
        push.close(linger=0)
        sub.close(linger=0)
        ctx.term()
        coordinator.stop()


def test_routing_least_loaded_pinned_and_dead_engines():
    client = DPClient(DPAddresses.create(None, None, 1), 0, dp_size=3)
    client.engines = {i: EngineInfo(i, f"n{i}", "h", 100 + i, 64, 100) for i in range(3)}
    client.counts = [[2, 0], [0, 5], [0, 1]]  # scores 8, 5, 1
    assert client.choose_engine() == 2
    assert client.counts[2] == [1, 1]  # counted locally until the coordinator's next update
    picks = [client.choose_engine() for _ in range(12)]
    assert picks.count(0) >= 2 and picks.count(1) >= 2 and picks.count(2) >= 2  # balances as load builds up
    assert client.choose_engine(rank=0) == 0
    with pytest.raises(RequestFailed, match="out of range") as err:
        client.choose_engine(rank=3)
    assert err.value.status == 400
    client._engine_died(1, "its actor ended")
    assert "data-parallel engine 1 (host h, node n1, pid 101) died: its actor ended" in client.dead[1]
    assert 1 not in {client.choose_engine() for _ in range(10)}
    with pytest.raises(RequestFailed) as err:
        client.choose_engine(rank=1)
    assert err.value.status == 503
    client._engine_died(0, "x")
    client._engine_died(2, "y")
    with pytest.raises(RequestFailed, match="no data-parallel engine can serve"):
        client.choose_engine()


def test_engines_sharing_a_host_share_its_kv_budget():
    """Each DP engine learns how many engines sit on its most crowded host (its KV budget's sharers)."""
    from pipejax.ray_executor.config import EngineConfig, ModelSource
    from pipejax.ray_executor.serving.engines import engines_sharing_hosts, with_engines_on_host

    assert engines_sharing_hosts([{"a"}, {"a"}]) == [2, 2]  # -dp 2 on one host
    assert engines_sharing_hosts([{"a"}, {"b"}, {"b"}]) == [1, 2, 2]
    assert engines_sharing_hosts([{"a", "b"}, {"b"}, {"c"}]) == [2, 2, 1]  # a stage on b shares b
    config = with_engines_on_host(EngineConfig(ModelSource("m")), 2)
    assert config.cache.engines_on_host == 2 and config.worker_config(0).cache.engines_on_host == 2


def test_an_idle_engine_checks_its_stages(monkeypatch):
    """With nothing to run, the loop asks the engine to check its stages every IDLE_CHECK_S (a lost one is
    healed then, not at the next request) and counts that as proof of life."""
    from pipejax.ray_executor.serving import engine_core

    monkeypatch.setattr(engine_core, "IDLE_CHECK_S", 0.2)
    with running_core(FakeCore, 0, warmup=False) as (core, router, pull, stats, result):
        assert router.poll(5000)
        router.recv_multipart()
        deadline = time.monotonic() + 10
        while core.engine.stage_checks < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.engine.stage_checks >= 2
        assert _recv(stats, msgspec.msgpack.Decoder(EngineStats).decode).health.proven_age_s < 2
