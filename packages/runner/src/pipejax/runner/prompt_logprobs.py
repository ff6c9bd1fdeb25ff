"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): for each prompt token after the first, its logprob
given the tokens before it, its rank in the vocabulary and the top N, from the final hidden states the last stage
returns for a step that asks (``StepShape.prompt_hidden``).

The host says which prompt token follows each computed token (``ScheduledRequest.prompt_targets``), so a prompt
prefilled in chunks gets its logprobs chunk by chunk. Like vLLM's, they are those of the raw logits: no penalty,
bias or grammar shapes a prompt token. At most ``ROWS`` hidden states are scored at a time, so a long prompt holds
[ROWS, V] logits in memory, not [prompt, V].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.runner.batch import ALL_LOGPROBS, ModelBatch, TokenLogprobs
from pipejax.runner.config import ModelConfig
from pipejax.runner.model import lm_head

ROWS = 256  # hidden states scored per call (a power of two: fewer rows are padded to the next one)
TOP_BUCKETS = (0, 1, 5, 20)  # top-N widths compiled (a wider ask compiles its own)


def _score(params, hidden, index, targets, *, cfg: ModelConfig, top: int):
    """hidden [T, E] at ``index`` [n] -> the logprob and rank of ``targets`` [n], and the top ``top``."""
    logprobs = jax.nn.log_softmax(lm_head(hidden[index], params, cfg), axis=-1)  # [n, V]
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, top)
    return chosen, rank, top_ids, top_logprobs


def scorer(cfg: ModelConfig) -> Callable:
    """The jitted scoring of one stage's model (each (rows, top) pair compiles once)."""
    return jax.jit(functools.partial(_score, cfg=cfg), static_argnames=("top",))


def prompt_logprobs(
    score: Callable, params: dict, hidden: jax.Array, batch: ModelBatch, vocab: int
) -> tuple[tuple[str, tuple[TokenLogprobs, ...]], ...]:
    """(request id, a ``TokenLogprobs`` per prompt target) for the requests of ``batch`` with prompt targets;
    ``hidden``: the step's final hidden states [T, E] (a request's tokens follow the previous one's)."""
    index: list[int] = []
    targets: list[int] = []
    asked: list[tuple[str, int, int]] = []  # (request id, first row, top N)
    start = 0
    for r in batch.requests:
        if r.prompt_targets:
            n = r.sampling.prompt_logprobs
            asked.append((r.request_id, len(index), vocab if n == ALL_LOGPROBS else min(n, vocab)))
            index += range(start, start + len(r.prompt_targets))
            targets += r.prompt_targets
        start += len(r.token_ids)
    if not asked:
        return ()
    most = max(n for _, _, n in asked)
    top = next((b for b in TOP_BUCKETS if b >= most), most)
    chosen, ranks, top_ids, top_logprobs = _in_chunks(score, params, hidden, index, targets, top)
    out = []
    for i, (request_id, first, n) in enumerate(asked):
        last = asked[i + 1][1] if i + 1 < len(asked) else len(index)
        out.append((request_id, tuple(
            TokenLogprobs(sampled=float(chosen[j]), rank=int(ranks[j]),
                          top=tuple(zip(top_ids[j, :n].tolist(), top_logprobs[j, :n].tolist(), strict=True)))
            for j in range(first, last))))
    return tuple(out)


def _in_chunks(score: Callable, params: dict, hidden: jax.Array, index: Sequence[int], targets: Sequence[int],
               top: int) -> tuple[np.ndarray, ...]:
    """``score`` over ``ROWS`` rows at a time (the last call padded to a power of two), joined on the host."""
    parts = []
    for a in range(0, len(index), ROWS):
        n = min(ROWS, len(index) - a)
        rows = 1 << max(0, n - 1).bit_length()
        pad = rows - n  # padding scores token 0 of row 0, and is dropped
        at = np.asarray([*index[a:a + n], *[0] * pad], np.int32)
        want = np.asarray([*targets[a:a + n], *[0] * pad], np.int32)
        result = jax.device_get(score(params, hidden, at, want, top=top))
        parts.append([x[:n] for x in result])
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))
