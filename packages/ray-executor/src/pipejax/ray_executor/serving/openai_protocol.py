"""The OpenAI-compatible request bodies (pydantic, validated by FastAPI) and the error body.

Unknown fields are accepted and ignored, as the established servers do; fields pipejax cannot honour
(``echo``, ``suffix``, ``best_of`` > ``n``) are refused with a 400 rather than ignored.
Besides OpenAI's penalties, ``logit_bias`` and ``response_format``, vLLM's extensions ``repetition_penalty``,
``min_tokens``, ``allowed_token_ids``, ``bad_words`` and ``structured_outputs`` are taken, with vLLM's meaning.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipejax.runner.batch import SamplingParams, StructuredOutputs

# vLLM's ``structured_outputs`` fields pipejax honours (its whitespace_pattern, structural_tag and
# disable_additional_properties are refused by name)
STRUCTURED_FIELDS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")


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
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: one of json, json_object, regex, choice, grammar
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top N (-1: all)
    data_parallel_rank: int | None = None  # pipejax/vLLM extension: pin the request to one DP engine

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        forced: StructuredOutputs | None = None) -> SamplingParams:
        """The engine's parameters; ``forced``: the grammar a forced tool call holds the answer to."""
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
                prompt_logprobs=self.prompt_logprobs,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                min_tokens=self.min_tokens, logit_bias=bias, allowed_token_ids=self.allowed_token_ids,
                bad_words=tuple(self.bad_words or ()), structured_outputs=self.structured(forced),
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def structured(self, forced: StructuredOutputs | None = None) -> StructuredOutputs | None:
        """The grammar ``structured_outputs`` (vLLM's) or ``response_format`` (OpenAI's) asks for, if any."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if forced is not None:
            if self.structured_outputs is not None or kind != "text":
                raise APIError(400, "a forced tool call (tool_choice 'required' or a named function) already sets "
                                    "the answer's format: leave out response_format and structured_outputs",
                               "tool_choice")
            return forced
        if self.structured_outputs is not None:
            if kind != "text":
                raise APIError(400, "give structured_outputs or response_format, not both", "response_format")
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_FIELDS))
            if unknown:
                raise APIError(400, f"structured_outputs fields {unknown} are not supported by pipejax; use "
                                    f"{', '.join(STRUCTURED_FIELDS)}", "structured_outputs")
            try:
                return StructuredOutputs(**{k: v for k, v in self.structured_outputs.items() if v is not None})
            except ValueError as exc:
                raise APIError(400, str(exc), "structured_outputs") from None
        if kind == "text":
            return None
        # OpenAI's formats name no whitespace option: JSON comes compact (a small model at temperature 1 can
        # otherwise spend its whole budget on free whitespace)
        if kind == "json_object":
            return StructuredOutputs(json_object=True, disable_any_whitespace=True)
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                               "response_format")
            return StructuredOutputs(json=schema, disable_any_whitespace=True)
        raise APIError(400, f"response_format.type={kind!r} is not one of 'text', 'json_object', 'json_schema'",
                       "response_format")

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

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: its text, and fields such as ``tool_calls``, ``tool_call_id``."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        return {**extra, "role": self.role, "content": self.text()}

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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
