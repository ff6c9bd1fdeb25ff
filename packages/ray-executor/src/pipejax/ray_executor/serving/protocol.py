"""What travels between the API servers, the DP engine cores and the coordinator (msgspec, never pickle).

Sockets and frames:

    API server i  ROUTER (binds)  <-- DEALER (identity = engine index)   engine e
                  [identity, RequestType, payload] both ways: ADD/ABORT/SHUTDOWN to an engine,
                  READY (EngineInfo) from it
    API server i  PULL   (binds)  <-- PUSH                                 engine e
                  [EngineCoreOutputs]
    coordinator   PULL   (binds)  <-- PUSH   [EngineStats]                 every engine
    coordinator   PUB    (binds)  --> SUB    [LoadUpdate]                  every API server
"""

from __future__ import annotations

import enum

import msgspec

from pipejax.runner.batch import SamplingParams


class RequestType(bytes, enum.Enum):
    """The first frame of every DEALER/ROUTER message: what the payload is."""

    ADD = b"\x00"  # EngineCoreRequest
    ABORT = b"\x01"  # list[str] of request ids
    SHUTDOWN = b"\x02"  # empty
    READY = b"\x03"  # EngineInfo (engine -> API server, once per connection)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n == 1: the API server fans n out into child requests
    client_index: int = 0  # which API server's PULL socket gets the outputs
    arrival_time: float = 0.0
    resume_token_ids: list[int] = []  # generated on an engine that was lost: go on from there (not sent again)


class Logprob(msgspec.Struct, array_like=True, gc=False):
    sampled: float
    top: list[tuple[int, float]] = []  # (token id, logprob), best first
    rank: int | None = None  # the sampled (or prompt) token's rank in the vocabulary, 1 = the most likely


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request gained in one engine step (deltas, so a long stream stays linear)."""

    request_id: str
    new_token_ids: list[int] = []
    new_text: str = ""
    text_len: int = 0  # length of the whole text so far; a stop string can cut it below what was sent
    new_logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    error_kind: str | None = None  # "invalid_request" (the client's fault) | "engine_dead"
    # with prompt_logprobs: None for the first prompt token, then each one's; sent once, with the first token
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int
    outputs: list[EngineCoreOutput] = []
    engine_dead: str | None = None  # the engine stopped serving: the cause (its requests are failed above)


class EngineInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sent by an engine on READY: who it is and what it accepts."""

    index: int
    node_id: str
    host: str
    pid: int
    max_model_len: int
    vocab_size: int
    kv_cache: str = ""  # the engine's KV cache line (``KVCachePlan.describe``), which the API server logs

    def describe(self) -> str:
        return f"data-parallel engine {self.index} (host {self.host}, node {self.node_id[:8]}, pid {self.pid})"


class EngineHealth(msgspec.Struct, array_like=True, gc=False):
    """An engine's proof of life and its healing so far (``LLMEngine.recovery``): ``proven_age_s`` is the time
    since it last finished a step or found every stage answering (an idle engine checks them); ``unplaced``
    says why it cannot serve while it waits for a node to take its lost stages (``EngineCore``)."""

    proven_age_s: float = 0.0
    recovering: bool = False
    recoveries: int = 0
    requests_moved: int = 0
    recovery_seconds: float = 0.0
    unplaced: str = ""  # why lost stages wait for a node (recovery timed out): it takes no requests until then


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """Engine -> coordinator, every ``STATS_INTERVAL_S``: load, and a heartbeat."""

    engine_index: int
    waiting: int
    running: int
    dead: str | None = None  # the cause, once the engine has failed
    health: EngineHealth | None = None
    incarnation: int = 0  # 0, then 1, 2, ... for each rebuild of this rank (older ones' stats are stale)


class LoadUpdate(msgspec.Struct, array_like=True, gc=False):
    """Coordinator -> API servers: per-engine [waiting, running], and the engines known dead (index -> cause).

    A cause never names the engine: receivers say "<EngineInfo.describe()> died: <cause>".
    """

    counts: list[list[int]]
    dead: dict[int, str] = {}
    health: dict[int, EngineHealth] = {}


STATS_INTERVAL_S = 0.1


def engine_identity(index: int) -> bytes:
    return index.to_bytes(2, "little")


def engine_index(identity: bytes) -> int:
    return int.from_bytes(identity, "little")
