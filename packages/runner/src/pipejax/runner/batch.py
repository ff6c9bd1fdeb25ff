"""The batch contract between a scheduler and a stage runner, as plain frozen types.

A ``ModelBatch`` is one ragged step: for every scheduled request, the token ids to compute
now (a prefill chunk or one decode token), where they start, the request's KV block table and
its sampling parameters. Non-last stages answer with ``IntermediateTensors``; the last stage
with a ``SamplerOutput``.
"""

from __future__ import annotations

import dataclasses
import json
import math


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """A grammar the whole output must follow (vLLM's ``StructuredOutputsParams``): exactly one of a JSON schema
    (``json``, kept as JSON text; a dict is taken), any JSON object (``json_object``), a ``regex``, a ``choice``
    of strings or a ``grammar`` (Lark or GBNF). ``disable_any_whitespace``: JSON without optional whitespace."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        asked = [k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k)]
        if len(asked) != 1:
            raise ValueError(f"structured_outputs must name exactly one of json, json_object, regex, choice and "
                             f"grammar; got {asked or 'none'}")
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError(f"structured_outputs.choice={list(self.choice)!r} must be non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k))


ALL_LOGPROBS = -1  # SamplingParams.logprobs asking for every token of the vocabulary (vLLM's -1)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (the established field names).

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. ``seed`` makes one request's samples reproducible whatever it is batched with.
    ``logprobs=N`` returns the sampled token's logprob and the top N (-1: every token of the vocabulary, as vLLM).
    ``prompt_logprobs=N`` likewise for each prompt token after the first, given the tokens before it (vLLM's).

    What shapes the logits before sampling, with vLLM's meaning (``logits_adjustment.LogitsAdjustment``):
    ``repetition_penalty`` (> 0, 1 = off) divides a positive logit and multiplies a negative one of every token
    in the prompt or the output; ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) subtract once per
    token present in the output and once per occurrence; ``logit_bias`` adds per token id (-100..100);
    ``allowed_token_ids`` keeps only those; ``bad_words_token_ids`` never completes one of those token sequences
    in the output; ``min_tokens`` keeps ``min_tokens_stop_ids`` (set by the engine: the end-of-sequence ids
    and ``stop_token_ids``) from being sampled before that many tokens. ``structured_outputs``: a grammar the
    output follows (the engine compiles it and sends each step's token bitmask, ``ScheduledRequest.token_bitmask``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is taken too
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()  # the engine adds their token sequences to bad_words_token_ids
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens_stop_ids: tuple[int, ...] = ()
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", (self.bad_words,) if isinstance(self.bad_words, str)
                           else tuple(self.bad_words or ()))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids or ()))
        object.__setattr__(self, "min_tokens_stop_ids", tuple(self.min_tokens_stop_ids or ()))
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n={self.n!r} must be an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r} must be in (0, 1] (1 = disabled)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k={self.top_k!r} must be an integer >= -1 (0 or -1 = disabled)")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append(f"min_p={self.min_p!r} must be in [0, 1] (0 = disabled)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            problems.append(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < ALL_LOGPROBS):
            problems.append(f"logprobs={self.logprobs!r} must be an integer >= 0, or -1 for the whole vocabulary")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < ALL_LOGPROBS):
            problems.append(f"prompt_logprobs={self.prompt_logprobs!r} must be an integer >= 0, or -1 for the whole "
                            f"vocabulary")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed={self.seed!r} must be an integer")
        if any(not s for s in self.stop):
            problems.append(f"stop={self.stop!r} must not contain empty strings")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name}={getattr(self, name)!r} must be in [-2, 2] (0 = off)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            problems.append(f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        elif self.max_tokens is not None and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        if any(not _finite(b) or not -100 <= b <= 100 for _, b in self.logit_bias):
            problems.append(f"logit_bias={dict(self.logit_bias)!r}: each bias must be in [-100, 100]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            problems.append("allowed_token_ids=[] would allow no token; leave it out to allow all")
        if any(not w for w in self.bad_words_token_ids):
            problems.append("bad_words_token_ids must not contain an empty word")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the request's tokens so far (``ScheduledRequest.history``): a penalty, or a
        bad word of several tokens."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or any(len(w) > 1 for w in self.bad_words_token_ids))

    def token_ids_used(self) -> set[int]:
        """Every token id the parameters name (for checking them against a vocabulary)."""
        used = {t for t, _ in self.logit_bias} | set(self.allowed_token_ids or ())
        return used.union(*self.bad_words_token_ids)


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` are computed at positions ``start_position ...``; ``block_table`` lists the KV
    blocks that hold positions ``0 ..`` of this request (enough for the tokens of this step).
    ``sample`` is False for a prefill chunk that does not reach the end of the prompt.
    ``output_index`` is how many tokens the request has generated so far (seeds its sampler).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    sample: bool = True
    output_index: int = 0
    # the request's tokens at positions 0 .. end_position (prompt, then outputs), where its sampling
    # ``needs_history`` (the last stage's penalties and bad words); else None
    history: tuple[int, ...] | None = None
    # what the request's grammar allows next (structured outputs): i32 words as bytes, bit t % 32 of word t // 32
    # allowing token t (vLLM's layout); None: no constraint
    token_bitmask: bytes | None = None
    # where ``sampling.prompt_logprobs`` asks for them and this step computes prompt tokens: the prompt token each
    # of ``token_ids`` is followed by (one fewer where the chunk ends the prompt); else None
    prompt_targets: tuple[int, ...] | None = None

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class ModelBatch:
    step_id: int
    requests: tuple[ScheduledRequest, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token, the top-N alternatives (token id, logprob), best first, and the
    sampled token's rank in the whole vocabulary (1 = the most likely)."""

    sampled: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """The last stage's answer: one token per request that asked to sample (in batch order)."""

    step_id: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    # (request id, one TokenLogprobs per ``ScheduledRequest.prompt_targets`` token) for the requests that asked for
    # prompt logprobs this step, whether or not they sample
    prompt_logprobs: tuple[tuple[str, tuple[TokenLogprobs, ...]], ...] = ()
