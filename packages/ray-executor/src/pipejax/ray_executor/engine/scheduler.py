"""Continuous batching with chunked prefill over a paged KV block manager.

Each ``schedule()`` builds one ragged ``ModelBatch`` within a token budget and a request budget:
running requests first (decode tokens or the next prefill chunk), then waiting ones in arrival
order. When blocks run out, the most recently admitted running request that is not in flight
is preempted by recompute: its blocks are freed and it goes back to the front of the queue,
to be prefilled again (prompt + what it generated) later. A request is in at most one batch in
flight; ``update()`` applies a batch's sampled tokens once it comes back.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

from pipejax.ray_executor.engine.block_manager import BlockManager
from pipejax.ray_executor.engine.request import Request, RequestStatus
from pipejax.runner.batch import ModelBatch, SamplerOutput, ScheduledRequest
from pipejax.runner.config import SchedulerConfig

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._step_ids = itertools.count()
        self.num_preemptions = 0

    # --- requests in and out -----------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use; give each request a unique id")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request now; its blocks are freed at once, or when its in-flight batch returns."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        req.abort()
        if not req.in_flight:
            self._release(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_active(self) -> int:
        return len(self.running) + len(self.waiting)

    # --- one step ----------------------------------------------------------------------------

    def schedule(self, max_seqs: int | None = None) -> ModelBatch | None:
        """The next batch (at most ``max_seqs`` requests), or None when every runnable request is in flight."""
        token_budget = self.config.max_num_batched_tokens
        max_seqs = min(max_seqs or self.config.max_num_seqs, self.config.max_num_seqs)
        scheduled: list[tuple[Request, int]] = []
        # Running requests, oldest first; preempt from the newest end when blocks run out.
        candidates = [r for r in self.running if not r.in_flight]
        while candidates and token_budget > 0 and len(scheduled) < max_seqs:
            req = candidates.pop(0)
            num_new = min(req.num_tokens - req.num_computed_tokens, token_budget)
            while not self.blocks.grow(req.block_ids, req.num_computed_tokens + num_new):
                victim = candidates.pop() if candidates else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                token_budget -= num_new
        # Waiting requests in arrival order, as long as budget and blocks allow (no preemption for them).
        while self.waiting and token_budget > 0 and len(scheduled) < max_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, token_budget)
            if not self.blocks.grow(req.block_ids, req.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            token_budget -= num_new
        if not scheduled:
            return None
        entries = []
        for req, num_new in scheduled:
            start = req.num_computed_tokens
            entries.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.token_ids(start, start + num_new),
                    start_position=start,
                    block_table=tuple(req.block_ids),
                    sampling=req.sampling,
                    sample=start + num_new == req.num_tokens,
                    output_index=len(req.output_token_ids),
                    history=req.token_ids(0, start + num_new)
                    if req.sampling.needs_history and start + num_new == req.num_tokens else None,
                    prompt_targets=req.prompt_targets(start, num_new),
                )
            )
            req.num_computed_tokens += num_new
            req.in_flight = True
        return ModelBatch(next(self._step_ids), tuple(entries))

    def update(self, batch: ModelBatch, output: SamplerOutput | None) -> list[Request]:
        """Apply a returned batch; returns the requests that got a token or finished."""
        sampled = {} if output is None else dict(zip(output.request_ids, range(len(output.request_ids)), strict=True))
        scored = {} if output is None else dict(output.prompt_logprobs)
        touched = []
        for entry in batch.requests:
            req = self.requests.get(entry.request_id)
            if req is None:
                continue
            req.in_flight = False
            if req.finished:  # aborted while in flight
                self._release(req)
                touched.append(req)
                continue
            if entry.request_id in scored:
                req.add_prompt_logprobs(entry.start_position, scored[entry.request_id])
            if entry.request_id in sampled:
                i = sampled[entry.request_id]
                req.append_token(output.token_ids[i], output.logprobs[i] if output.logprobs else None)
                touched.append(req)
                if req.finished:
                    self._release(req)
        return touched

    def preempt_all(self) -> int:
        """Every batch in flight is lost (a stage was): each unfinished request keeps its prompt and the tokens
        it generated, drops its KV blocks and waits at the front of the queue, in its order, to be prefilled
        again; a request aborted while in flight is released. Returns how many requests were preempted."""
        moved = 0
        for req in reversed(list(self.running)):  # newest first: each goes to the front, so the oldest leads
            req.in_flight = False
            if req.finished:
                self._release(req)
            else:
                self._preempt(req)
                moved += 1
        return moved

    def fail(self, batch: ModelBatch, reason: str) -> list[Request]:
        """A batch could not be executed: finish its requests with an error."""
        requests = [self.requests[e.request_id] for e in batch.requests if e.request_id in self.requests]
        return [self._fail(req, reason) for req in requests]

    def fail_all(self, reason: str) -> list[Request]:
        """Finish every waiting and running request with an error (the executor is gone)."""
        return [self._fail(req, reason) for req in list(self.waiting) + list(self.running)]

    # --- internals ---------------------------------------------------------------------------

    def _fail(self, req: Request, reason: str) -> Request:
        req.in_flight = False
        if not req.finished:
            req.abort()
            req.finish_reason, req.stop_reason = "error", reason
        self._release(req)
        return req

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        log.info("preempted %s by recompute (%d free blocks)", req.request_id, self.blocks.num_free)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
