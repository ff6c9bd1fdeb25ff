"""What the HTTP handlers share: the DP client, the tokenizer, metrics, and a request's choices as they grow.

``Frontend.run_choices`` fans one HTTP request (several prompts x ``n``) out into engine requests on
one engine, and yields a ``Choice`` each time one of them changes; leaving the iteration early (the
client went away) cancels the rest, which aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from pipejax.ray_executor.serving.addresses import DPAddresses
from pipejax.ray_executor.serving.client import DPClient, RequestFailed
from pipejax.ray_executor.serving.metrics import ServerMetrics
from pipejax.ray_executor.serving.openai_protocol import APIError
from pipejax.ray_executor.serving.protocol import EngineCoreOutput, Logprob
from pipejax.runner.batch import SamplingParams
from pipejax.runner.tokenizer import Tokenizer, has_tokenizer

log = logging.getLogger(__name__)

# An engine that has neither finished a step nor checked its stages for this long (and is not healing) fails
# /health: its loop is stuck (an idle engine checks every ``engine_core.IDLE_CHECK_S``).
PROVEN_WITHIN_S = 60.0


@dataclasses.dataclass(frozen=True)
class FrontendConfig:
    """One API server: which DP client it is, what it serves, how long it waits."""

    addresses: DPAddresses
    client_index: int
    dp_size: int
    model_path: str
    served_model_name: str
    api_key: str | None = None
    ready_timeout_s: float = 900.0  # engines build and compile before they announce themselves
    output_timeout_s: float = 600.0  # the longest a request may wait for its next output


@dataclasses.dataclass
class Choice:
    """One completion (prompt x sample) as it grows."""

    index: int
    prompt_len: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_chars: int = 0  # streaming: how much has gone out
    sent_tokens: int = 0
    finish_sent: bool = False

    def apply(self, out: EngineCoreOutput) -> None:
        self.text = (self.text + out.new_text)[: out.text_len]
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class Frontend:
    def __init__(self, config: FrontendConfig):
        self.config = config
        self.client = DPClient(config.addresses, config.client_index, config.dp_size, config.output_timeout_s)
        self.metrics = ServerMetrics()
        self.client.on_migrated = lambda lost, to: self.metrics.migrated.labels(str(lost)).inc()
        path = Path(config.model_path)
        self.tokenizer = Tokenizer.from_pretrained(path) if has_tokenizer(path) else None
        self.started = time.time()

    async def start(self, should_exit=lambda: False) -> None:
        await self.client.start(self.config.ready_timeout_s, should_exit)
        log.info("API server %d: %d data-parallel engines ready (max_model_len %d)",
                 self.config.client_index, len(self.client.engines), self.client.max_model_len)

    async def close(self) -> None:
        await self.client.close()

    # --- request preparation ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{self.config.model_path} has no tokenizer.json; send token ids as the prompt",
                               param="prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def chat_prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """``messages`` (and ``tools``, for templates that render them) through the model's chat template."""
        if self.tokenizer is None:
            raise APIError(400, f"{self.config.model_path} has no tokenizer: chat needs one", param="messages")
        if tools and not self.tokenizer.renders_tools:
            raise APIError(400, f"the chat template of {self.config.served_model_name} does not render tools, so "
                                f"the model would not see them; use a model whose template does, or "
                                f"tool_choice='none'", param="tools")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except Exception as exc:  # the template's raise_exception, or a jinja error on odd messages
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompts(self, prompts: list[list[int]], max_tokens: int | None) -> None:
        limit, vocab = self.client.max_model_len, self.client.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty; give at least one token", param="prompt")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
            if len(ids) + (max_tokens or 1) > limit:
                raise APIError(
                    400, f"this model's maximum context length is {limit} tokens; the request has {len(ids)} "
                         f"prompt tokens and asks for {max_tokens or 1} more; shorten the prompt or lower max_tokens",
                    param="max_tokens" if max_tokens and len(ids) < limit else "prompt")

    def choose_engine(self, rank: int | None, requests: int) -> int:
        try:
            return self.client.choose_engine(rank, requests)
        except RequestFailed as exc:
            raise APIError(exc.status, str(exc), param="data_parallel_rank" if rank is not None else None) from None

    # --- running ---------------------------------------------------------------------------------

    async def run_choices(
        self, engine: int, prompts: list[list[int]], params: SamplingParams, n: int, arrival: float
    ) -> AsyncIterator[Choice]:
        base = f"{self.config.client_index}-{uuid.uuid4().hex[:16]}"
        queue: asyncio.Queue = asyncio.Queue()
        tasks = []
        for p, ids in enumerate(prompts):
            for k in range(n):
                choice = Choice(p * n + k, len(ids))
                sample = params if params.seed is None else dataclasses.replace(params, seed=params.seed + k)
                coro = self._pump(f"{base}-{choice.index}", ids, sample, engine, choice, queue, arrival)
                tasks.append(asyncio.create_task(coro))
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if isinstance(item, RequestFailed):
                    raise item
                if item is None:
                    left -= 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, request_id: str, ids: list[int], params: SamplingParams, engine: int, choice: Choice,
                    queue: asyncio.Queue, arrival: float) -> None:
        m, label = self.metrics, str(engine)
        last = None
        try:
            async for out in self.client.generate(request_id, ids, params, engine):
                now = time.monotonic()
                if out.new_token_ids:
                    (m.ttft.labels(label).observe(now - arrival) if last is None
                     else m.itl.labels(label).observe(now - last))
                    last = now
                    m.generation_tokens.labels(label).inc(len(out.new_token_ids))
                choice.apply(out)
                queue.put_nowait(choice)
            m.prompt_tokens.labels(label).inc(len(ids))
            m.requests.labels(label, choice.finish_reason or "unknown").inc()
            m.e2e.labels(label).observe(time.monotonic() - arrival)
            queue.put_nowait(None)
        except RequestFailed as exc:
            m.failed.labels(label, exc.kind).inc()
            queue.put_nowait(exc)

    async def collect(self, choices: AsyncIterator[Choice], count: int) -> list[Choice]:
        done: dict[int, Choice] = {}
        async for choice in choices:
            done[choice.index] = choice
        return [done[i] for i in range(count)]

    # --- output helpers --------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def health(self) -> tuple[int, dict]:
        """200 while every engine proves it can step (it finished a step, or found its stages answering, within
        ``PROVEN_WITHIN_S``) or is healing a lost stage ("degraded" then); 503 naming the engines that cannot
        ("degraded" while one serves or waits for a node for its lost stages, "dead" where none does)."""
        c = self.client
        engines, failing, recovering = [], [], []
        for index in range(c.dp_size):
            info, h = c.engines.get(index), c.health.get(index)
            stale = h is not None and not h.recovering and h.proven_age_s > PROVEN_WITHIN_S
            error = c.dead.get(index) or c.unplaced(index) or (
                f"{c.describe(index)} has not stepped nor checked its stages for {h.proven_age_s:.0f}s"
                if stale else None)
            if error:
                failing.append(error)
            if h is not None and h.unplaced:
                recovering.append(index)
            elif h is not None and h.recovering:
                recovering.append(index)
            engines.append({
                "index": index, "alive": info is not None and not error,
                "host": info.host if info else None, "node_id": info.node_id if info else None,
                "pid": info.pid if info else None, "waiting": c.counts[index][0], "running": c.counts[index][1],
                "routed": c.routed[index], "error": error,
                "recovering": bool(h and (h.recovering or h.unplaced)), "recoveries": h.recoveries if h else 0,
                "proven_s_ago": round(h.proven_age_s, 1) if h else None,
            })
        if not failing:
            status = "degraded" if recovering else "ok"
        else:  # "dead" only where no engine serves nor heals
            status = "degraded" if len(failing) < c.dp_size or recovering else "dead"
        body = {"status": status, "api_server": self.config.client_index, "engines": engines}
        if failing:
            body["error"] = "; ".join(failing)
        return (200 if not failing else 503), body
