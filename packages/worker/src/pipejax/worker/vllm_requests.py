"""vLLM's ``SchedulerOutput`` -> pipejax's ``ModelBatch``: the per-request state a stage keeps.

vLLM's scheduler sends each step only what changed: new requests whole, cached ones as deltas
(computed-token count, blocks to append, or a new table when a preempted request resumes; under
pipeline parallelism also the step's input tokens, which no other rank than the last one could
know). ``RequestStates`` folds those deltas into what the runner needs: every scheduled request's
tokens for this step, its start position and its block table. vLLM's block ids are the runner's
pages as they are (vLLM keeps block 0 as its null block, and so does the runner), so a prefix-cache
hit is just a table whose first blocks already hold the prefix's K/V.

Only attribute reads on vLLM's objects here (no vLLM import), so it is cheap to test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from pipejax.runner.batch import ModelBatch, SamplerOutput, SamplingParams, ScheduledRequest, TokenLogprobs

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy


class UnsupportedFeatureError(ValueError):
    """A vLLM feature pipejax's stages do not implement; the message names it."""


def unsupported_sampling(params) -> list[str]:
    """What of vLLM's ``SamplingParams`` pipejax cannot honour, each named with its value (empty: all fine)."""
    found = []
    for name in ("logits_processors", "prompt_logprob_token_ids"):  # structured outputs: vLLM sends their bitmasks
        if value := getattr(params, name, None):
            found.append(f"{name}={value!r}")
    return found


def to_sampling_params(params) -> SamplingParams:
    """pipejax's sampling parameters for one of vLLM's (stop conditions stay vLLM's)."""
    problems = unsupported_sampling(params)
    if problems:
        raise UnsupportedFeatureError(f"pipejax does not support {', '.join(problems)}")
    greedy = params.temperature < GREEDY_EPS
    min_tokens = int(getattr(params, "min_tokens", 0) or 0)
    return SamplingParams(
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=0 if greedy or params.top_k in (None, -1) else int(params.top_k),
        min_p=0.0 if greedy else float(params.min_p),
        seed=params.seed,
        max_tokens=None,
        logprobs=params.logprobs,
        prompt_logprobs=getattr(params, "prompt_logprobs", None),
        # penalties and logits shaping, as vLLM's sampler applies them (its processor tokenized the bad words)
        repetition_penalty=float(getattr(params, "repetition_penalty", 1.0)),
        presence_penalty=float(getattr(params, "presence_penalty", 0.0)),
        frequency_penalty=float(getattr(params, "frequency_penalty", 0.0)),
        min_tokens=min_tokens,
        min_tokens_stop_ids=tuple(sorted(getattr(params, "all_stop_token_ids", ()) or ())) if min_tokens else (),
        logit_bias={int(t): float(b) for t, b in (getattr(params, "logit_bias", None) or {}).items()},
        allowed_token_ids=getattr(params, "allowed_token_ids", None) or None,
        bad_words_token_ids=tuple(tuple(w) for w in getattr(params, "bad_words_token_ids", None) or ()),
    )


@dataclasses.dataclass
class RequestState:
    prompt_len: int
    tokens: list[int]  # prompt + outputs, as far as this stage knows them
    block_ids: list[int]
    sampling: SamplingParams
    num_computed: int = 0
    # with prompt_logprobs: prompt token i + 1's at [i], filled chunk by chunk until the prompt is done (then None)
    prompt_scores: list[TokenLogprobs | None] | None = None

    def prompt_targets(self, start: int, end: int) -> tuple[int, ...] | None:
        """The prompt token that follows each of tokens ``start:end``, while prompt logprobs are owed."""
        if self.prompt_scores is None or start >= self.prompt_len - 1:
            return None
        return tuple(self.tokens[start + 1 : min(end + 1, self.prompt_len)])


class RequestStates:
    """The requests a stage has seen, updated from each ``SchedulerOutput``."""

    def __init__(self):
        self.requests: dict[str, RequestState] = {}
        self.counts = {"new": 0, "prefix_hits": 0, "resumed": 0, "steps": 0}

    def update(self, so) -> None:
        """Fold one step's deltas in (finished, new and cached requests)."""
        for req_id in so.finished_req_ids:  # the request, not its blocks: vLLM reuses them for prefix hits
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise UnsupportedFeatureError(f"request {new.req_id!r}: prompt embeddings are not supported")
            (blocks,) = _one_group(new.block_ids, new.req_id)
            self.requests[new.req_id] = RequestState(
                prompt_len=len(new.prompt_token_ids),
                tokens=list(new.prompt_token_ids),
                block_ids=list(blocks),
                sampling=(sampling := to_sampling_params(new.sampling_params)),
                num_computed=new.num_computed_tokens,  # > 0: a prefix-cache hit
                prompt_scores=None if sampling.prompt_logprobs is None else [None] * (len(new.prompt_token_ids) - 1),
            )
            self.counts["new"] += 1
            self.counts["prefix_hits"] += new.num_computed_tokens > 0
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted, rescheduled: a whole new table
                state.block_ids = list(_one_group(new_blocks, req_id)[0]) if new_blocks else []
                self.counts["resumed"] += 1
            elif new_blocks is not None:
                state.block_ids.extend(_one_group(new_blocks, req_id)[0])
            if req_id in cached.all_token_ids:
                state.tokens = list(cached.all_token_ids[req_id])
            if cached.new_token_ids:  # pipeline parallel: this step's input tokens
                fed = cached.new_token_ids[i]
                state.tokens[state.num_computed : state.num_computed + len(fed)] = fed
            # Outputs the scheduler no longer counts (e.g. after a failed step) are dropped.
            del state.tokens[state.prompt_len + cached.num_output_tokens[i] :]

    def batch(self, so, step_id: int) -> ModelBatch:
        """This step's ``ModelBatch``: requests in the scheduler's order (new, then cached)."""
        order = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        out = []
        for req_id in order:
            n = so.num_scheduled_tokens[req_id]
            if n == 0:
                continue
            state = self.requests[req_id]
            start, end = state.num_computed, state.num_computed + n
            if end > len(state.tokens):
                raise RuntimeError(
                    f"request {req_id!r}: scheduled positions {start}..{end - 1} but this stage knows "
                    f"{len(state.tokens)} tokens (a SchedulerOutput was missed)"
                )
            out.append(ScheduledRequest(
                request_id=req_id,
                token_ids=tuple(state.tokens[start:end]),
                start_position=start,
                block_table=tuple(state.block_ids),
                sampling=state.sampling,
                sample=end == len(state.tokens),  # a prefill chunk short of the prompt's end samples nothing
                output_index=end - state.prompt_len,
                history=tuple(state.tokens[:end]) if state.sampling.needs_history else None,
                prompt_targets=state.prompt_targets(start, end),
            ))
        self.counts["steps"] += 1
        return ModelBatch(step_id, tuple(out))

    def record_prompt_logprobs(
        self, batch: ModelBatch, output: SamplerOutput
    ) -> dict[str, tuple[list[int], list[TokenLogprobs]]]:
        """Place a step's prompt logprobs; for each request whose prompt this step finished, its prompt tokens
        after the first and their logprobs (vLLM takes them once, when the prompt's last chunk is done)."""
        scored = dict(output.prompt_logprobs)
        done = {}
        for r in batch.requests:
            state = self.requests.get(r.request_id)
            if state is None or state.prompt_scores is None:
                continue
            chunk = scored.get(r.request_id, ())
            state.prompt_scores[r.start_position : r.start_position + len(chunk)] = chunk
            if r.end_position >= state.prompt_len:
                done[r.request_id] = state.tokens[1 : state.prompt_len], state.prompt_scores
                state.prompt_scores = None
        return done

    def record(self, output: SamplerOutput) -> None:
        """The last stage learns its sampled tokens (earlier stages get them in the next step's deltas)."""
        for req_id, token in zip(output.request_ids, output.token_ids, strict=True):
            if (state := self.requests.get(req_id)) is not None:
                state.tokens.append(token)


def _one_group(block_ids: Iterable, req_id: str) -> tuple:
    groups = tuple(block_ids)
    if len(groups) != 1:
        raise UnsupportedFeatureError(
            f"request {req_id!r} has {len(groups)} KV cache groups; pipejax runs one full-attention group"
        )
    return groups
