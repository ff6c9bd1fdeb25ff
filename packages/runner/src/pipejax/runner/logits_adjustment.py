"""Logits shaped before sampling, for the rows whose parameters ask for it (``LogitsAdjustment``, applied by
``adjust_logits``), in vLLM v1's order: a structured output's token bitmask (its grammar's next allowed tokens),
allowed token ids, bad words, ``min_tokens`` and ``logit_bias``, then the repetition, frequency and presence
penalties. The adjustment is a pytree whose arrays are padded to power-of-two widths; a step where no row asks
has none (``LogitsAdjustment.build`` returns None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _width(n: int) -> int:
    """A padded width for ``n`` entries: 0, or a power of two >= 8 (few programs for varying counts)."""
    return 0 if n == 0 else max(8, 1 << (n - 1).bit_length())


class LogitsAdjustment(NamedTuple):
    """Per-row logits shaping for R padded rows (a pytree; entries padded with the vocabulary size, which the
    scatters drop). ``bias`` holds ``logit_bias`` and, as -inf, the banned tokens: the last token of a bad word
    whose other tokens end the output, and the stop ids of a request short of ``min_tokens``."""

    penalties: np.ndarray | jax.Array  # f32[R, 3]: repetition (1 = off), presence, frequency
    history: np.ndarray | jax.Array  # i32[R, L]: prompt and output tokens so far
    from_output: np.ndarray | jax.Array  # bool[R, L]: which of them are outputs
    bias_ids: np.ndarray | jax.Array  # i32[R, B]
    bias: np.ndarray | jax.Array  # f32[R, B]
    allowed_ids: np.ndarray | jax.Array  # i32[R, A]
    restricted: np.ndarray | jax.Array  # bool[R]: only ``allowed_ids`` may be sampled
    bitmask: np.ndarray | jax.Array  # i32[R, ceil(V / 32)] (or [R, 0]): bit t % 32 of word t // 32 allows token t

    @classmethod
    def build(cls, requests: Sequence, num_rows: int, vocab: int,
              bitmasks: Mapping[str, np.ndarray] | None = None) -> LogitsAdjustment | None:
        """For ``requests`` (``ScheduledRequest``s, one row each) padded to ``num_rows``; ``bitmasks``: request id
        -> its grammar's token bitmask for this step (vLLM's layout; else a request's own ``token_bitmask``); None
        where nothing asks."""
        histories = [r.history if r.history is not None and r.sampling.needs_history else () for r in requests]
        masks = [_bitmask(r, bitmasks) for r in requests]
        biases = [list(r.sampling.logit_bias) + [(t, -np.inf) for t in _banned(r)] for r in requests]
        allowed = [r.sampling.allowed_token_ids for r in requests]
        if (not any(biases) and not any(h for h in histories) and all(a is None for a in allowed)
                and all(m is None for m in masks)):
            return None
        L = _width(max(map(len, histories), default=0))
        B = _width(max(map(len, biases), default=0))
        A = _width(max((len(a) for a in allowed if a is not None), default=0))
        penalties = np.tile(np.array([1.0, 0.0, 0.0], np.float32), (num_rows, 1))
        history = np.full((num_rows, L), vocab, np.int32)
        from_output = np.zeros((num_rows, L), bool)
        bias_ids = np.full((num_rows, B), vocab, np.int32)
        bias = np.zeros((num_rows, B), np.float32)
        allowed_ids = np.full((num_rows, A), vocab, np.int32)
        restricted = np.zeros(num_rows, bool)
        words = -(-vocab // 32)
        constrained = any(m is not None for m in masks)
        bitmask = np.full((num_rows, words if constrained else 0), -1, np.int32)  # -1: every token allowed
        for row, r in enumerate(requests):
            if (mask := masks[row]) is not None:
                mask = mask[:words]
                bitmask[row, :mask.size] = mask
                bitmask[row, mask.size:] = 0  # tokens past the grammar's vocabulary: never
            p = r.sampling
            penalties[row] = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            if histories[row]:
                n = len(histories[row])
                history[row, :n] = histories[row]
                from_output[row, n - r.output_index:n] = True
            if biases[row]:
                ids, values = zip(*biases[row], strict=True)
                bias_ids[row, :len(ids)], bias[row, :len(ids)] = ids, values
            if allowed[row] is not None:
                allowed_ids[row, :len(allowed[row])] = allowed[row]
                restricted[row] = True
        return cls(penalties, history, from_output, bias_ids, bias, allowed_ids, restricted, bitmask)


def _bitmask(request, bitmasks: Mapping[str, np.ndarray] | None) -> np.ndarray | None:
    """The request's token bitmask this step: vLLM's (``bitmasks``), else the one its batch entry carries."""
    if bitmasks and (mask := bitmasks.get(request.request_id)) is not None:
        return np.asarray(mask, np.int32)
    if request.token_bitmask is not None:
        return np.frombuffer(request.token_bitmask, np.int32)
    return None


def _banned(request) -> list[int]:
    """The tokens ``request`` may not sample now: the last token of each bad word whose other tokens end its
    output (vLLM's rule: the output, not the prompt), and its stop ids while short of ``min_tokens``."""
    p = request.sampling
    history = request.history or ()
    outputs = tuple(history[len(history) - request.output_index:]) if request.history is not None else ()
    ban = [w[-1] for w in p.bad_words_token_ids
           if len(w) == 1 or (len(w) - 1 <= len(outputs) and outputs[len(outputs) - len(w) + 1:] == w[:-1])]
    return ban + list(p.min_tokens_stop_ids) if request.output_index < p.min_tokens else ban


def adjust_logits(logits: jax.Array, adj: LogitsAdjustment) -> jax.Array:
    """``logits`` [R, V] shaped as ``adj`` says (vLLM v1's order; the penalties as its ``apply_penalties``)."""
    rows, vocab = logits.shape
    row = jnp.arange(rows)[:, None]
    if adj.bitmask.shape[1]:
        bits = (adj.bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
        logits = jnp.where(bits.reshape(rows, -1)[:, :vocab] == 1, logits, -jnp.inf)
    if adj.allowed_ids.shape[1]:
        allowed = jnp.zeros((rows, vocab), bool).at[row, adj.allowed_ids].set(True, mode="drop")
        logits = jnp.where(adj.restricted[:, None] & ~allowed, -jnp.inf, logits)
    if adj.bias_ids.shape[1]:
        logits = logits.at[row, adj.bias_ids].add(adj.bias, mode="drop")
    if adj.history.shape[1]:
        counts = jnp.zeros((rows, vocab), jnp.float32).at[row, adj.history].add(
            adj.from_output.astype(jnp.float32), mode="drop")  # occurrences in the output
        seen = jnp.zeros((rows, vocab), bool).at[row, adj.history].set(True, mode="drop")  # prompt or output
        repetition, presence, frequency = (adj.penalties[:, i:i + 1] for i in range(3))
        logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - frequency * counts - presence * (counts > 0)
    return logits
