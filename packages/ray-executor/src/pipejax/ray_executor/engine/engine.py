"""The engine: requests in, outputs out. One step = schedule -> execute (a future) -> update.

With PP = N it keeps up to N batches in flight (a batch queue) so every stage has work; a
request is in at most one of them (the scheduler skips requests in flight).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from pipejax.pp_utils import ParallelConfig
from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.engine.block_manager import BlockManager
from pipejax.ray_executor.engine.request import Request, RequestDelta, RequestOutput
from pipejax.ray_executor.engine.scheduler import Scheduler
from pipejax.ray_executor.engine.structured import Grammars
from pipejax.ray_executor.executor.base import Executor, NoStageLost, StagesLost
from pipejax.ray_executor.executor.factory import create_executor
from pipejax.ray_executor.platforms import current_platform
from pipejax.runner.batch import ModelBatch, SamplerOutput, SamplingParams
from pipejax.runner.config import AUTO_PARTITION, auto_partition, check_expert_parallel
from pipejax.runner.tokenizer import Tokenizer, has_tokenizer

log = logging.getLogger(__name__)


HEALTH_CHECK_AFTER_S = 3.0  # a step pending this long makes the engine ask the executor whether stages are alive



def requests_per_batch(active: int, depth: int) -> int:
    """At most how many of ``active`` requests a step takes with ``depth`` batches in flight: the active requests
    split into ``depth`` batches (arrival order), so that every pipeline stage has one to work on."""
    return max(1, math.ceil(active / depth))

@dataclasses.dataclass
class RecoveryStats:
    """What healing cost so far (serving's /metrics): recoveries done, requests moved back to the queue to be
    prefilled again, seconds from a loss's detection to the pipeline's reconnection; the last one's phases."""

    recoveries: int = 0
    requests_moved: int = 0
    seconds: float = 0.0
    last_phases: dict[str, float] = dataclasses.field(default_factory=dict)
    last_started: float = 0.0  # time.monotonic() when the last recovery began (its loss was detected)


class StepTimeout(RuntimeError):
    """A batch did not come back from the stages within ``step_timeout_s``."""


class EngineDeadError(RuntimeError):
    """The executor failed (a stage died, a host was lost, a step never came back). Every unfinished
    request was failed with this error (``failed_outputs``: their last outputs, finish reason "error";
    ``failed_deltas``: the same as deltas, for ``step_deltas`` callers); the engine accepts no more work,
    unless ``revivable``: a lost stage found no node within the recovery timeout, and ``LLMEngine.revive``
    may place it later (when a host joins or comes back)."""

    def __init__(
        self, reason: str, failed_outputs: Sequence[RequestOutput] = (), failed_deltas: Sequence[RequestDelta] = (),
        revivable: bool = False,
    ):
        super().__init__(reason)
        self.failed_outputs: list[RequestOutput] = list(failed_outputs)
        self.failed_deltas: list[RequestDelta] = list(failed_deltas)
        self.revivable = revivable


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, placement_group=None):
        """``placement_group``: one the caller already created (e.g. Ray Serve, the DP launcher) for the
        Ray executor's stages; None lets the executor create (and remove) its own."""
        self.model_config = config.model.model_config()
        requested_len = config.scheduler.max_model_len
        # max_model_len is resolved here, once, against the model; the stages get it resolved.
        parallel = checked_layout(config.parallel, config.platform_plugin)
        if parallel.enable_expert_parallel and self.model_config.moe is not None:  # refused before stages start
            check_expert_parallel(self.model_config.moe.num_experts, parallel.tensor_parallel_size)
        if parallel.pp_layer_partition == AUTO_PARTITION:  # resolved once: the stages get counts, the log one line
            counts = auto_partition(self.model_config, parallel.pipeline_parallel_size)
            parallel = dataclasses.replace(parallel, pp_layer_partition=counts)
        config = dataclasses.replace(config, parallel=parallel, scheduler=config.scheduler.for_model(self.model_config))
        self.config = config
        path = config.model.path
        self.tokenizer = Tokenizer.from_pretrained(path) if has_tokenizer(path) else None
        self.executor = executor or create_executor(config, placement_group)
        blocks = BlockManager(self.executor.num_kv_blocks, self.executor.block_size)
        max_len = min(config.scheduler.max_model_len, blocks.capacity_tokens)  # the scheduler's limit
        if max_len < (requested_len or 0):
            log.warning("KV cache holds only %d tokens: max_model_len lowered to that", max_len)
        self.max_model_len = max_len
        self.scheduler = Scheduler(dataclasses.replace(config.scheduler, max_model_len=max_len), blocks)
        self.eos_token_ids = frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids
        )
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.dead: EngineDeadError | None = None
        self.recovery = RecoveryStats()
        self.recovering = False  # a lost stage is being replaced (read by serving's stats thread)
        self._in_flight: deque[tuple[ModelBatch, Future[SamplerOutput]]] = deque()
        # (time, batches in flight) after each submit, for the last ``config.step_trace_len`` submits
        self.in_flight_trace: deque[tuple[float, int]] = deque(maxlen=config.step_trace_len)

    # --- requests ----------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | Sequence[int] | dict, sampling: SamplingParams | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """Validate and queue a request; a bad one raises ``ValueError`` and changes nothing.
        ``resume_token_ids``: what the request generated on another engine that was lost (it goes on from there:
        they are prefilled with the prompt and count as its output)."""
        if self.dead is not None:
            raise self.dead
        sampling = sampling or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {self.model_config.vocab_size})"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens but "
                f"max_model_len={self.max_model_len} leaves no room to generate; "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
        sampling = self._resolve_sampling(request_id, sampling)
        if sampling.prompt_logprobs is not None and self.config.model.impl != "jax":
            raise ValueError(f"request {request_id!r}: prompt_logprobs are computed by the native JAX model only, "
                             f"not model_impl={self.config.model.impl!r}; leave prompt_logprobs out")
        grammar = None
        if sampling.structured_outputs is not None:
            grammar = self.grammars.matcher(request_id, sampling.structured_outputs)
            if resume_token_ids and not grammar.consume_tokens([int(t) for t in resume_token_ids]):
                raise ValueError(f"request {request_id!r}: its resume_token_ids do not follow its structured_outputs")
            # the stages need only each step's bitmask, not the grammar's text
            sampling = dataclasses.replace(sampling, structured_outputs=None)
        room = self.max_model_len - len(token_ids)
        max_tokens = min(sampling.max_tokens or room, room)
        if len(resume_token_ids) >= max_tokens:
            raise ValueError(f"request {request_id!r}: resumes after {len(resume_token_ids)} tokens but may generate "
                             f"only {max_tokens}: it was already complete")
        req = Request(request_id, token_ids, sampling, max_tokens, self.eos_token_ids, self.tokenizer, text)
        if resume_token_ids:
            req.resume([int(t) for t in resume_token_ids])
        req.grammar = grammar
        self.scheduler.add(req)

    def _resolve_sampling(self, request_id: str, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` checked against the vocabulary, with what the sampler needs from the tokenizer: the bad
        words as token sequences (each as written and after a space, as vLLM encodes them) and the ids
        ``min_tokens`` holds back (the end-of-sequence ids and ``stop_token_ids``)."""
        changes = {}
        if sampling.bad_words:
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: bad_words need the model's tokenizer; give "
                                 f"bad_words_token_ids instead")
            words = list(sampling.bad_words_token_ids)
            for word in sampling.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                    if ids and ids not in words:
                        words.append(ids)
            changes["bad_words_token_ids"] = tuple(words)
        if sampling.min_tokens:
            eos = () if sampling.ignore_eos else tuple(sorted(self.eos_token_ids))
            changes["min_tokens_stop_ids"] = tuple(dict.fromkeys(eos + sampling.stop_token_ids))
        sampling = dataclasses.replace(sampling, **changes) if changes else sampling
        bad = sorted(t for t in sampling.token_ids_used() if not 0 <= t < self.model_config.vocab_size)
        if bad:
            raise ValueError(f"request {request_id!r}: logit_bias / allowed_token_ids / bad words name token ids "
                             f"{bad[:5]} outside the vocabulary [0, {self.model_config.vocab_size})")
        return sampling

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return req.output() if req else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; every request that got a token or finished, whole (the offline API's form)."""
        return [r.output() for r in self._step()]

    def step_deltas(self) -> list[RequestDelta]:
        """One engine step; what each request that got a token or finished gained since its previous
        delta (serving's form: no per-step copies of whole requests)."""
        return [r.delta() for r in self._step()]

    def step_finished(self) -> list[RequestOutput]:
        """One engine step; only the requests that finished in it, whole (``LLM.generate``'s form: each request
        is copied once, when it ends, instead of every step)."""
        return [r.output() for r in self._step() if r.finished]

    def _step(self) -> list[Request]:
        if self.dead is not None:
            raise self.dead
        batch = None
        depth = self.executor.max_concurrent_batches
        if len(self._in_flight) < depth:
            batch = self.scheduler.schedule(max_seqs=requests_per_batch(self.scheduler.num_active(), depth))
            if batch is not None:
                batch = self._with_bitmasks(batch)
                self._in_flight.append((batch, self.executor.execute_model(batch)))
                if self.config.step_trace_len:
                    self.in_flight_trace.append((time.perf_counter(), len(self._in_flight)))
        if not self._in_flight:
            return []
        full = len(self._in_flight) >= self.executor.max_concurrent_batches
        if full or batch is None or self._in_flight[0][1].done():
            return self._finish_oldest()
        return []

    def _with_bitmasks(self, batch: ModelBatch) -> ModelBatch:
        """``batch`` with the token bitmask of each sampling row whose request follows a grammar (computed while
        the batches in flight run)."""
        requests = self.scheduler.requests
        rows = [i for i, e in enumerate(batch.requests) if e.sample and requests[e.request_id].grammar is not None]
        if not rows:
            return batch
        masks = self.grammars.bitmasks([requests[batch.requests[i].request_id].grammar for i in rows])
        entries = list(batch.requests)
        for i, mask in zip(rows, masks, strict=True):
            entries[i] = dataclasses.replace(entries[i], token_bitmask=mask.tobytes())
        return dataclasses.replace(batch, requests=tuple(entries))

    def _finish_oldest(self) -> list[Request]:
        batch, future = self._in_flight.popleft()
        try:
            output = self._wait(batch, future)
        except Exception as exc:
            self._in_flight.appendleft((batch, future))
            self.heal(exc)
            return []
        return self.scheduler.update(batch, output)

    def heal(self, exc: Exception) -> None:
        """A step, or work between steps (a warm-up shape, a stage check), failed with ``exc``: recover (every
        batch in flight is dropped), or die naming it where recovery is off or fails."""
        if self.dead is not None:
            raise self.dead
        if not (self.config.recovery and self.executor.can_recover):
            self._die(exc)
        self._recover(exc)

    def check_stages(self) -> None:
        """Between steps, nothing in flight (an idle server's probe): a stage lost meanwhile is replaced now,
        not when the next request arrives; with recovery off, the engine dies now, naming it."""
        if self.dead is not None:
            raise self.dead
        if self._in_flight:
            return
        lost = self.executor.lost_stages()
        if lost:
            self.heal(StagesLost(f"stage(s) {lost} found lost between steps", lost))

    def _recover(self, exc: Exception) -> None:
        """A stage was lost: pause (every batch in flight is dropped, its requests keep the tokens they have and
        wait to be prefilled again: nothing a client received is taken back), let the executor replace the
        lost stages, go on. Where it cannot within ``recovery_timeout_s``, the engine dies as without recovery,
        naming both errors."""
        start = time.monotonic()
        reason = f"{type(exc).__name__}: {exc}"
        self._in_flight.clear()
        moved = self.scheduler.preempt_all()
        log.warning("a stage was lost (%s); %d requests wait to be prefilled again", reason.splitlines()[0], moved)
        lost = exc.lost if isinstance(exc, StagesLost) else None
        try:
            phases = self._replace_lost(lost)
        except Exception as failure:  # noqa: BLE001 - the engine dies naming both
            self._die(RuntimeError(f"{reason}; recovery failed: {type(failure).__name__}: {failure}"),
                      revivable=not isinstance(failure, NoStageLost))
        self._recovered(start, phases, moved)

    def revive(self) -> bool:
        """After a recovery that failed (``EngineDeadError.revivable``: no node could take a lost stage in time),
        try once more, for up to ``recovery_timeout_s``: True once the stages are whole again and the engine
        takes work as before (the requests failed with the error are not brought back), False if not yet."""
        if self.dead is None or not self.dead.revivable:
            raise RuntimeError(f"revive() is for an engine whose recovery failed; this one is "
                               f"{'alive' if self.dead is None else f'dead for good: {self.dead}'}")
        start = time.monotonic()
        try:
            phases = self._replace_lost(None)
        except Exception as failure:  # noqa: BLE001 - still no room: the caller tries again later
            log.warning("the lost stage(s) are still not placed: %s: %s", type(failure).__name__, failure)
            return False
        self.dead = None
        self._recovered(start, phases, 0)
        return True

    def _replace_lost(self, lost: list[int] | None) -> dict[str, float]:
        self.recovering = True
        try:
            return self.executor.recover(self.config.recovery_timeout_s, lost)
        finally:
            self.recovering = False

    def _recovered(self, start: float, phases: dict[str, float], moved: int) -> None:
        seconds = time.monotonic() - start
        self.recovery.recoveries += 1
        self.recovery.requests_moved += moved
        self.recovery.seconds += seconds
        self.recovery.last_phases = {**phases, "total": seconds}
        self.recovery.last_started = start
        log.warning("recovered in %.1fs (%s); %d requests resume", seconds,
                    ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()), moved)

    def _wait(self, batch: ModelBatch, future: Future[SamplerOutput]) -> SamplerOutput:
        """The batch's output; while it is pending, stages are health-checked so a lost one fails fast."""
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            try:
                return future.result(timeout=min(HEALTH_CHECK_AFTER_S, max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    late = f"step {batch.step_id} did not finish within {self.config.step_timeout_s}s"
                    hung = self.executor.hung_stages(batch.step_id)
                    if hung:  # alive, answering pings, and stuck: replaced as a lost stage
                        raise StagesLost(f"{late}: stage(s) {hung} had not finished it (hung)", hung) from None
                    raise StepTimeout(late) from None
                self.executor.check_health()

    def _die(self, exc: Exception, revivable: bool = False) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        log.error("engine stopped: %s", reason)
        failed = []
        for batch, _ in self._in_flight:
            failed += self.scheduler.fail(batch, reason)
        self._in_flight.clear()
        failed += self.scheduler.fail_all(reason)
        self.dead = EngineDeadError(reason, [r.output() for r in failed], [r.delta() for r in failed], revivable)
        raise self.dead from exc

    def shutdown(self) -> None:
        self.executor.shutdown()

    # --- helpers -----------------------------------------------------------------------------

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"prompt dict {sorted(prompt)} has no 'prompt_token_ids'; use a string or that key")
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.config.model.path} has no tokenizer.json; pass {{'prompt_token_ids': [...]}}"
                )
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        return None, [int(t) for t in prompt]


def checked_layout(parallel: ParallelConfig, platform_plugin: str | None = None) -> ParallelConfig:
    """The platform (``platform_plugin``'s, or the one that applies) validates pp x tp against this host and
    picks the backend when none was asked.

    With Ray, the cluster's capacity is checked by the placement group instead (it knows the nodes).
    """
    if parallel.distributed_executor_backend == "ray":
        return parallel
    try:
        return current_platform(platform_plugin).check_and_update_config(parallel)
    except ValueError as exc:
        import jax

        listing = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices())
        raise ValueError(f"{exc} (devices in this process: {listing})") from None
