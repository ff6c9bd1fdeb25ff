"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): completions, chat, models, health, metrics.

Errors are OpenAI-shaped (``{"error": {message, type, param, code}}``): malformed JSON and bad
parameters 400, a missing/wrong ``--api-key`` 401, an unknown model 404, a request whose engine
died 500 naming the engine, no engine alive 503. A client that disconnects has its request
aborted in the engine (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipejax.ray_executor.serving.client import RequestFailed
from pipejax.ray_executor.serving.frontend import Choice, Frontend, FrontendConfig
from pipejax.ray_executor.serving.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from pipejax.ray_executor.serving.tools import ToolChoice, ToolStream

log = logging.getLogger(__name__)

RANK_HEADER = "x-data-parallel-rank"


def build_app(config: FrontendConfig) -> FastAPI:
    frontend = Frontend(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await frontend.start(should_exit=lambda: app.state.should_exit())
        yield
        await frontend.close()

    app = FastAPI(title="pipejax", lifespan=lifespan)
    app.state.frontend = frontend
    app.state.should_exit = lambda: False
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = frontend.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        c = frontend.client
        frontend.metrics.set_engine_load(c.counts, set(c.engines), set(c.dead))
        frontend.metrics.set_engine_health(c.health)
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": config.served_model_name, "object": "model", "created": int(frontend.started),
                "owned_by": "pipejax", "root": config.model_path, "max_model_len": frontend.client.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        arrival = time.monotonic()
        frontend.check_model(body.model)
        prompts = [frontend.prompt_ids(p) for p in body.prompts()]
        frontend.check_prompts(prompts, body.max_tokens)
        params = body.sampling_params(body.max_tokens, body.logprobs)
        engine = frontend.choose_engine(_rank(raw, body.data_parallel_rank), len(prompts) * body.n)
        choices = frontend.run_choices(engine, prompts, params, body.n, arrival)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": config.served_model_name}
        usage = _Usage(prompts)
        if body.stream:
            return SSEResponse(_completion_events(frontend, choices, head, body, usage, prompts))
        done = await _unless_disconnected(raw, frontend.collect(choices, len(prompts) * body.n))
        out = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": _completion_logprobs(frontend, c, 0) if body.logprobs is not None else None,
                "prompt_logprobs": _prompt_logprobs(frontend, c, prompts[c.index // body.n])}
               for c in done]
        return {**head, "object": "text_completion", "choices": out, "usage": usage.of(done)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        arrival = time.monotonic()
        frontend.check_model(body.model)
        tools = ToolChoice(body.tools, body.tool_choice, body.parallel_tool_calls)
        prompt = frontend.chat_prompt_ids([m.for_template() for m in body.messages], tools.template_tools(body.tools))
        max_tokens = body.requested_max_tokens()
        frontend.check_prompts([prompt], max_tokens)
        params = body.sampling_params(max_tokens, body.requested_logprobs(), tools.constraint())
        engine = frontend.choose_engine(_rank(raw, body.data_parallel_rank), body.n)
        choices = frontend.run_choices(engine, [prompt], params, body.n, arrival)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": config.served_model_name}
        usage = _Usage([prompt])
        if body.stream:
            return SSEResponse(_chat_events(frontend, choices, head, body, usage, tools))
        done = await _unless_disconnected(raw, frontend.collect(choices, body.n))
        out = []
        for c in done:
            message, finish_reason = tools.message(c.text, c.finish_reason)
            logprobs = _chat_logprobs(frontend, c, 0) if body.logprobs else None
            out.append({"index": c.index, "message": message, "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason, "logprobs": logprobs})
        return {**head, "object": "chat.completion", "choices": out, "usage": usage.of(done),
                "prompt_logprobs": _prompt_logprobs(frontend, done[0], prompt)}

    return app


# --- requests ------------------------------------------------------------------------------------


def _rank(raw: Request, from_body: int | None) -> int | None:
    header = raw.headers.get(RANK_HEADER)
    if header is None:
        return from_body
    try:
        return int(header)
    except ValueError:
        raise APIError(400, f"header X-data-parallel-rank={header!r} is not an integer") from None


async def _unless_disconnected(raw: Request, work):
    """Run ``work`` unless the client goes away first; then cancel it (which aborts the engine requests)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


class _Usage:
    def __init__(self, prompts: list[list[int]]):
        self.prompt_tokens = sum(len(p) for p in prompts)

    def of(self, choices) -> dict:
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


# --- streaming -----------------------------------------------------------------------------------


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and close their generator (aborting the requests), when the client leaves."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch():
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        except OSError:  # the client went away mid-send
            pass
        finally:
            await self.body_iterator.aclose()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _take_delta(choice: Choice, holdback: int) -> tuple[str, int, bool]:
    """Text not yet sent (keeping back what a stop string could still cut), tokens not yet sent, finish now?"""
    finished = choice.finish_reason is not None
    end = len(choice.text) if finished else max(choice.sent_chars, len(choice.text) - holdback)
    text = choice.text[choice.sent_chars:end]
    first_token = choice.sent_tokens
    choice.sent_chars, choice.sent_tokens = end, len(choice.token_ids)
    finish_now = finished and not choice.finish_sent
    choice.finish_sent = choice.finish_sent or finished
    return text, first_token, finish_now


async def _events(choices: AsyncIterator[Choice], body, make_chunk, head, usage: _Usage, prefix=()):
    holdback = max((len(s) for s in ([body.stop] if isinstance(body.stop, str) else body.stop or [])), default=1) - 1
    seen: dict[int, Choice] = {}
    try:
        for chunk in prefix:
            yield _sse(chunk)
        async for choice in choices:
            seen[choice.index] = choice
            text, first_token, finish_now = _take_delta(choice, holdback)
            if text or finish_now or first_token < len(choice.token_ids):
                for chunk in make_chunk(choice, text, first_token, finish_now):
                    yield _sse(chunk)
        if usage is not None and body.include_usage:
            yield _sse({**head, "choices": [], "usage": usage.of(seen.values())})
    except (RequestFailed, APIError) as exc:
        status = exc.status
        yield _sse(error_body(status, str(exc)))
    yield "data: [DONE]\n\n"


def _completion_events(frontend: Frontend, choices, head, body: CompletionRequest, usage: _Usage,
                       prompts: list[list[int]]):
    head = {**head, "object": "text_completion"}

    def chunk(c: Choice, text: str, first_token: int, finish_now: bool) -> list[dict]:
        logprobs = _completion_logprobs(frontend, c, first_token) if body.logprobs is not None else None
        choice = {"index": c.index, "text": text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason if finish_now else None}
        if first_token == 0 and c.prompt_logprobs is not None:  # with the choice's first chunk, as vLLM
            choice["prompt_logprobs"] = _prompt_logprobs(frontend, c, prompts[c.index // body.n])
        return [{**head, "choices": [choice]}]

    return _events(choices, body, chunk, head, usage)


def _chat_events(frontend: Frontend, choices, head, body: ChatCompletionRequest, usage: _Usage, tools: ToolChoice):
    head = {**head, "object": "chat.completion.chunk"}
    streams = {i: ToolStream(tools) for i in range(body.n)} if tools.active else None

    def chunk(c: Choice, text: str, first_token: int, finish_now: bool) -> list[dict]:
        logprobs = _chat_logprobs(frontend, c, first_token) if body.logprobs else None
        finish_reason = c.finish_reason if finish_now else None
        if streams is None:
            deltas = [{"content": text}] if text else []
        else:  # tool calls: the text read back into content and tool_calls deltas
            deltas = streams[c.index].feed(text)
            if finish_now:
                last, finish_reason = streams[c.index].finish(c.finish_reason)
                deltas += last
        deltas = deltas or [{}]
        return [{**head, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                                      "finish_reason": finish_reason if i == len(deltas) - 1 else None}]}
                for i, delta in enumerate(deltas)]

    roles = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]} for i in range(body.n)]
    return _events(choices, body, chunk, head, usage, prefix=roles)


# --- logprobs ------------------------------------------------------------------------------------


def _completion_logprobs(frontend: Frontend, c: Choice, start: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = len(frontend.tokenizer.decode(c.token_ids[:start])) if start and frontend.tokenizer else 0
    for token_id, lp in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
        text = frontend.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(lp.sampled)
        top.append({frontend.token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _prompt_logprobs(frontend: Frontend, c: Choice, prompt: list[int]) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the prompt token and the top N."""
    if c.prompt_logprobs is None:
        return None

    def entry(logprob: float, rank: int | None, token_id: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": frontend.token_text(token_id)}

    out: list[dict | None] = [None]
    for token_id, lp in zip(prompt[1:], c.prompt_logprobs[1:], strict=True):
        top = {str(t): entry(v, i + 1, t) for i, (t, v) in enumerate(lp.top) if t != token_id}
        out.append({str(token_id): entry(lp.sampled, lp.rank, token_id), **top})  # the prompt token first
    return out


def _chat_logprobs(frontend: Frontend, c: Choice, start: int) -> dict:
    def entry(token_id: int, value: float) -> dict:
        text = frontend.token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = [{**entry(t, lp.sampled), "top_logprobs": [entry(a, v) for a, v in lp.top]}
               for t, lp in zip(c.token_ids[start:], c.logprobs[start:], strict=False)]
    return {"content": content}


# --- errors and auth -----------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestFailed)
    async def failed(request: Request, exc: RequestFailed) -> JSONResponse:
        return JSONResponse(error_body(exc.status, str(exc), code=exc.kind), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the requests were aborted

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = errors[0].get("ctx", {}).get("error", "")
            return JSONResponse(error_body(400, f"malformed JSON body: {detail}".rstrip(": ")), status_code=400)
        parts, param = [], None
        for err in errors[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            param = param or loc or None
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return JSONResponse(error_body(400, "; ".join(parts) or "invalid request", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)


class APIKeyMiddleware:
    """``/v1/*`` needs ``Authorization: Bearer <key>`` (a plain ASGI middleware: streaming stays untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body(401, "missing or wrong API key; send 'Authorization: Bearer <key>'")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- serving -------------------------------------------------------------------------------------


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so several API server processes can share one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve_http(config: FrontendConfig, host: str, port: int, stop_when: threading.Event | None = None) -> int:
    """Run one API server until SIGINT/SIGTERM, or until ``stop_when`` is set; 1 when it could not start (e.g. an
    engine never came up)."""
    app = build_app(config)
    sock = listening_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30,
                                           lifespan="on", timeout_graceful_shutdown=5))
    log.info("API server %d listening on http://%s:%d", config.client_index, host, port)
    app.state.should_exit = lambda: server.should_exit  # lets a signal interrupt the wait for engines
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal that stopped it; the launcher still has engines to stop.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    if stop_when is not None:
        threading.Thread(target=lambda: stop_when.wait() and setattr(server, "should_exit", True),
                         name="api-stop-when", daemon=True).start()
    asyncio.run(server.serve(sockets=[sock]))
    return 0 if server.started else 1


def api_server_process(config: FrontendConfig, host: str, port: int) -> None:
    """``multiprocessing`` target of API server i (``--api-server-count`` > 1)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s api{config.client_index} %(levelname)s %(message)s")
    raise SystemExit(serve_http(config, host, port))
