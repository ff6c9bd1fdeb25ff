"""A request's life in the engine, and the outputs users see (the established shapes)."""

from __future__ import annotations

import dataclasses
import enum

from pipejax.runner.batch import SamplingParams, TokenLogprobs
from pipejax.runner.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, then its TokenLogprobs (vLLM's)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclasses.dataclass
class RequestDelta:
    """What one request gained since its previous delta (the engine's output while serving: a stream
    stays linear in its length). ``text_len`` is the whole text's length: a stop string can cut the
    text below what earlier deltas carried."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    text_len: int
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # set once the request finished
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first token (``RequestOutput``'s)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """Mutable engine-side state of one request (one completion; n > 1 is fanned out by the caller)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        tokenizer: Tokenizer | None,
        prompt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset() if sampling.ignore_eos else eos_token_ids
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if sampling.logprobs is not None else None
        # prompt token i + 1's logprobs at [i], filled as its prefill chunks come back (a recompute refills them)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if sampling.prompt_logprobs is None else [None] * (len(prompt_token_ids) - 1))
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (counted when scheduled)
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.in_flight = False  # part of a batch that has not come back yet
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.grammar = None  # an llguidance matcher where the output follows a grammar (structured outputs)
        self._delta_tokens = 0  # output tokens (and logprobs) that earlier deltas carried
        self._delta_chars = 0  # characters of text that earlier deltas carried
        self._prompt_logprobs_sent = False
        self._detok = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, sampling.skip_special_tokens) if tokenizer else None
        )

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens ``start:stop`` of prompt + output, without joining the two (a decode step takes one token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return tuple(self.output_token_ids[start - p : stop - p])
        if stop <= p:
            return tuple(self.prompt_token_ids[start:stop])
        return (*self.prompt_token_ids[start:], *self.output_token_ids[: stop - p])

    def prompt_targets(self, start: int, num_new: int) -> tuple[int, ...] | None:
        """For a step computing tokens ``start:start + num_new``: the prompt token that follows each, where this
        request asks for prompt logprobs and the step still computes prompt tokens (``ScheduledRequest``)."""
        if self.prompt_logprobs is None or start >= len(self.prompt_token_ids) - 1:
            return None
        return tuple(self.prompt_token_ids[start + 1 : start + num_new + 1])

    def add_prompt_logprobs(self, start: int, scored: tuple[TokenLogprobs, ...]) -> None:
        self.prompt_logprobs[start : start + len(scored)] = scored

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def resume(self, token_ids: list[int]) -> None:
        """Tokens this request already generated on an engine that was lost: they count as its output (its
        budget, penalties, seeds go on from them) and are not sent again; only what follows is."""
        self.output_token_ids = list(token_ids)
        if self.logprobs is not None:
            self.logprobs = [None] * len(token_ids)  # the client has them already
        if self._detok is not None:
            self.text = self._detok.add(token_ids)
        self._delta_tokens, self._delta_chars = len(self.output_token_ids), len(self.text)

    def append_token(self, token: int, logprobs: TokenLogprobs | None) -> None:
        """Record a sampled token and decide whether the request stops here."""
        self.output_token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self._detok is not None:
            self.text += self._detok.add([token])
        if self.grammar is not None and self._grammar_ends(token):
            return
        if len(self.output_token_ids) < self.sampling.min_tokens:  # no stop before min_tokens (as vLLM)
            return
        if token in self.eos_token_ids:
            self._finish("stop", token)
        elif token in self.sampling.stop_token_ids:
            self._finish("stop", token)
        elif self._stop_string_hit():
            pass
        elif len(self.output_token_ids) >= self.max_tokens:
            self._finish("length")

    def _grammar_ends(self, token: int) -> bool:
        """Advance the grammar by ``token``; True where the request ends here: the grammar is complete (it allows
        nothing but the end of sequence), or refused the token (an error: the bitmask should have prevented it)."""
        if not self.grammar.consume_token(token):
            self.finish_reason, self.stop_reason = "error", f"the grammar refused token {token}: " + (
                self.grammar.get_error().strip())
            self.status = RequestStatus.FINISHED
            return True
        if self.grammar.is_stopped():
            self._finish("stop", token if token in self.eos_token_ids else None)
            return True
        return False

    def _stop_string_hit(self) -> bool:
        """Stop at the first stop string; the text is cut before it (as the established servers do)."""
        for stop in self.sampling.stop:
            # only the tail can contain a new match
            at = self.text.find(stop, max(0, len(self.text) - len(stop) - 64))
            if at != -1:
                self.text = self.text[:at]
                self._finish("stop", stop)
                return True
        return False

    def _finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = RequestStatus.FINISHED
        if self._detok is not None and not isinstance(stop_reason, str):
            self.text += self._detok.flush()

    def abort(self) -> None:
        self.finish_reason = "abort"
        self.status = RequestStatus.FINISHED

    def delta(self) -> RequestDelta:
        """What this request gained since the previous ``delta()`` (since it was added, the first time)."""
        start, chars = self._delta_tokens, self._delta_chars
        self._delta_tokens, self._delta_chars = len(self.output_token_ids), len(self.text)
        prompt_logprobs = None  # complete once the prompt's last chunk sampled a token
        if self.prompt_logprobs is not None and self.output_token_ids and not self._prompt_logprobs_sent:
            prompt_logprobs, self._prompt_logprobs_sent = [None, *self.prompt_logprobs], True
        return RequestDelta(
            self.request_id,
            self.output_token_ids[start:],
            self.text[chars:],
            len(self.text),
            self.logprobs[start:] if self.logprobs is not None else None,
            self.finish_reason if self.finished else None,
            self.stop_reason,
            prompt_logprobs,
        )

    def output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        prompt_logprobs = None if self.prompt_logprobs is None else [None, *self.prompt_logprobs]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [completion], self.finished,
                             prompt_logprobs)
