"""The OpenAI-compatible request bodies (pydantic, validated by FastAPI) and the error body.

Unknown fields are accepted and ignored, as the established servers do; fields pipejax cannot honour
(``echo``, ``suffix``, ``best_of`` > ``n``) are refused with a 400 rather than ignored. Besides OpenAI's
penalties and ``logit_bias``, vLLM's extensions ``repetition_penalty``, ``min_tokens``, ``allowed_token_ids`` and
``bad_words`` are taken, with vLLM's meaning.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipejax.runner.batch import SamplingParams


class APIError(Exception):
    """A request the server refuses; rendered as ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             500: "server_error", 503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = APIError.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension, as the ones below
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # OpenAI's keys: token ids as strings
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    data_parallel_rank: int | None = None  # pipejax/vLLM extension: pin the request to one DP engine

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            bias = {int(t): b for t, b in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, f"logit_bias={self.logit_bias!r}: its keys must be token ids", "logit_bias") from None
        try:
            return SamplingParams(
                n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                seed=self.seed, max_tokens=max_tokens, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                min_tokens=self.min_tokens, logit_bias=bias, allowed_token_ids=self.allowed_token_ids,
                bad_words=tuple(self.bad_words or ()),
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        if self.echo:
            raise APIError(400, "echo=true is not supported by pipejax", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by pipejax", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of")
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise APIError(400, "prompt is empty; give a string, a list of strings or token ids", param="prompt")
        return prompts


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"message content part of type {part.get('type')!r} is not supported; "
                                    f"this model reads text only", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
