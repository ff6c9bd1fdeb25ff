"""The last stage's sampler: one jitted function over fixed, padded row buckets.

Per row, in vLLM v1's order: greedy rows (temperature < 1e-5) take the argmax of the raw
logits; the others divide by the temperature, drop tokens below ``min_p`` x the top
probability, then apply top-k and top-p (nucleus, on what top-k kept) and draw one uniform number
from the row's own key against the running sum of what is left (inverse CDF). Logprobs are always of
the raw model distribution (``log_softmax(logits)``), as vLLM returns them by default; with
``num_logprobs=None`` none are computed.

Keys are made on the host: a seeded request's key depends only on ``(seed, output_index)`` so
its samples do not depend on its batch or the step; an unseeded one's on ``(step_seed, row)``.

Before any of that, rows whose parameters ask for it get their logits shaped (``logits_adjustment``: a
grammar's bitmask, allowed ids, bad words, ``min_tokens``, ``logit_bias``, the penalties). The adjustment is a
second pytree argument; a step where no row asks passes None, and compiles and runs the sampler it did before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.runner.batch import SamplerOutput, SamplingParams, TokenLogprobs
from pipejax.runner.logits_adjustment import LogitsAdjustment, adjust_logits

# vLLM's _SAMPLING_EPS: below this temperature a row is sampled greedily.
GREEDY_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1
_SEEDED_TAG = 0x5EED_5EED_5EED_5EED
_UNSEEDED_TAG = 0x57E9_57E9_57E9_57E9


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function (splitmix64's finalizer); host-side, deterministic."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _key_words(tag: int, a: int, b: int) -> tuple[int, int]:
    """Two uint32 words of threefry key data derived from (tag, a, b)."""
    mixed = _splitmix64((_splitmix64((a ^ tag) & _MASK64) + (b & _MASK64)) & _MASK64)
    return mixed >> 32, mixed & 0xFFFFFFFF


class SamplingMetadata(NamedTuple):
    """Per-row sampling parameters for R padded rows (a pytree; padding rows are greedy)."""

    temperature: np.ndarray | jax.Array  # f32[R], 0 = greedy
    top_k: np.ndarray | jax.Array  # i32[R], 0 = off
    top_p: np.ndarray | jax.Array  # f32[R], 1 = off
    min_p: np.ndarray | jax.Array  # f32[R], 0 = off
    keys: np.ndarray | jax.Array  # u32[R, 2], raw threefry2x32 key data

    @classmethod
    def build(
        cls,
        rows: Sequence[tuple[SamplingParams, int, str]],
        num_rows: int,
        step_seed: int,
    ) -> SamplingMetadata:
        """Host arrays for ``rows`` = (params, output_index, request_id), padded to ``num_rows``."""
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} rows do not fit num_rows={num_rows}; pick a larger row bucket")
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        keys = np.zeros((num_rows, 2), np.uint32)
        for row, (params, output_index, _request_id) in enumerate(rows):
            temperature[row] = params.temperature
            top_k[row] = max(params.top_k, 0)
            top_p[row] = params.top_p
            min_p[row] = params.min_p
            if params.seed is not None:
                keys[row] = _key_words(_SEEDED_TAG, params.seed, output_index)
            else:
                keys[row] = _key_words(_UNSEEDED_TAG, step_seed, row)
        return cls(temperature, top_k, top_p, min_p, keys)


class SampleResult(NamedTuple):
    tokens: jax.Array  # i32[R]
    sampled_logprob: jax.Array  # f32[R], raw logprob of the chosen token
    top_ids: jax.Array  # i32[R, N], best first
    top_logprobs: jax.Array  # f32[R, N]
    sampled_rank: jax.Array  # i32[R], 1 + how many tokens have a larger logit than the chosen one


def _ordered_bits(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (-inf < ... < -0 < +0 < ... < inf), for bisection."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_cut(bits: jax.Array, weights: jax.Array | None, target: jax.Array) -> jax.Array:
    """Per row, the largest cut c with sum(weights[bits >= c]) >= target.  # u32[R]

    Built bit by bit from the top (32 masked reductions, no sort); ``weights=None`` counts. The
    cut is always some element's bits, so ``bits >= cut`` keeps exactly the tokens at or above
    the k-th largest value (top-k) or the last token of the smallest prefix reaching p (top-p).
    """

    def add_bit(i, cut):
        candidate = cut | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        above = bits >= candidate[:, None]  # [R, V]
        if weights is None:
            reached = jnp.sum(above, axis=-1, dtype=jnp.int32) >= target
        else:
            reached = jnp.sum(jnp.where(above, weights, 0.0), axis=-1) >= target
        return jnp.where(reached, candidate, cut)

    return jax.lax.fori_loop(0, 32, add_bit, jnp.zeros(bits.shape[:1], jnp.uint32))


def _filters_on(top_k: jax.Array, top_p: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Per row, whether top-k and whether top-p filter anything.  # ([R], [R]) bool"""
    return (top_k > 0) & (top_k < vocab), top_p < 1.0


def _top_k_top_p_cut(scaled: jax.Array, bits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row cut (in ``_ordered_bits`` space) of top-k, then top-p on what top-k kept.  # [R]

    ``scaled`` already has min-p's dropped tokens at -inf; ``bits`` is its ``_ordered_bits``.
    Ties with the cut value survive (as in vLLM's top-k). A disabled filter gives cut 0, which
    keeps everything; a filter no row uses costs nothing (``lax.cond``).
    """
    no_cut = jnp.zeros(scaled.shape[:1], jnp.uint32)
    k_on, p_on = _filters_on(top_k, top_p, scaled.shape[-1])
    k_cut = jax.lax.cond(jnp.any(k_on), lambda: jnp.where(k_on, _largest_cut(bits, None, top_k), 0), lambda: no_cut)

    def nucleus_cut():
        kept = bits >= k_cut[:, None]
        weights = jnp.where(kept, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
        probs = weights / jnp.sum(weights, axis=-1, keepdims=True)  # renormalized over top-k
        return jnp.where(p_on, _largest_cut(bits, probs, top_p), 0)

    p_cut = jax.lax.cond(jnp.any(p_on), nucleus_cut, lambda: no_cut)
    return jnp.maximum(k_cut, p_cut)


_VOCAB_BLOCK = 128  # the two-level reductions below work on [R, V / 128, 128]


def _vocab_blocks(x: jax.Array, fill) -> jax.Array:
    """[R, V] -> [R, ceil(V / 128), 128], the tail padded with ``fill``."""
    rows, vocab = x.shape
    pad = -vocab % _VOCAB_BLOCK
    if pad:
        x = jnp.concatenate([x, jnp.full((rows, pad), fill, x.dtype)], axis=-1)
    return x.reshape(rows, -1, _VOCAB_BLOCK)


def _first_index(hits: jax.Array) -> jax.Array:
    """Per row, the first index along the last axis where ``hits`` holds (its length where none does)."""
    n = hits.shape[-1]
    return jnp.min(jnp.where(hits, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _argmax(x: jax.Array) -> jax.Array:
    """Row argmax, lowest index on ties (like torch.argmax).  # i32[R]

    Two levels: the first 128-wide block holding the row's max, then the first max in it. On XLA:CPU
    at [64, 32000] this took 0.4 ms against 4.5 for ``lax.top_k(x, 1)`` and 4.9 for ``jnp.argmax`` (a one-off probe,
    2026-12-01, not kept in this repository).
    """
    blocks = _vocab_blocks(x, -jnp.inf)
    block_max = jnp.max(blocks, axis=-1)  # [R, nb]
    top = jnp.max(block_max, axis=-1, keepdims=True)
    block = jnp.minimum(_first_index(block_max == top), blocks.shape[1] - 1)  # a NaN row: no hit, stay in range
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [R, 128]
    index = block * _VOCAB_BLOCK + _first_index(inner == top)
    return jnp.minimum(index, x.shape[-1] - 1)


def _inverse_cdf(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Per row, how many tokens' running weight sum stays <= ``uniform`` x the row's total.  # i32[R]

    The running sum is taken in two levels (block sums, then inside the one block the draw falls in)
    instead of a cumsum over the vocabulary, which on XLA:CPU took 7.9 ms at [64, 32000] (0.4 ms here; the same
    one-off probe).
    """
    blocks = _vocab_blocks(weights, 0.0)
    block_sums = jnp.sum(blocks, axis=-1)  # [R, nb]
    block_ends = jnp.cumsum(block_sums, axis=-1)
    target = (uniform * block_ends[:, -1])[:, None]
    block = jnp.minimum(jnp.sum(block_ends <= target, axis=-1, dtype=jnp.int32), blocks.shape[1] - 1)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [R, 128]
    before = jnp.take_along_axis(block_ends - block_sums, block[:, None], axis=1)  # [R, 1]
    count = block * _VOCAB_BLOCK + jnp.sum(before + jnp.cumsum(inner, axis=-1) <= target, axis=-1, dtype=jnp.int32)
    return jnp.minimum(count, weights.shape[-1])  # not into the padding


def _random_tokens(logits: jax.Array, meta: SamplingMetadata, greedy: jax.Array) -> jax.Array:
    """Temperature, min-p, top-k, top-p, then an inverse-CDF draw per row.  # i32[R]

    One uniform number per row (not one per vocabulary entry, as Gumbel-max needs): on the CPU,
    generating R x V random numbers cost more than the rest of the sampler together.
    """
    temperature = jnp.where(greedy, 1.0, meta.temperature)
    scaled = logits / temperature[:, None]  # [R, V]
    min_p = jnp.where(greedy, 0.0, meta.min_p)

    def drop_below_min_p():
        top = jnp.max(scaled, axis=-1, keepdims=True)
        return jnp.where(jnp.exp(scaled - top) < min_p[:, None], -jnp.inf, scaled)

    scaled = jax.lax.cond(jnp.any(min_p > 0), drop_below_min_p, lambda: scaled)

    top_k = jnp.where(greedy, 0, meta.top_k)
    top_p = jnp.where(greedy, 1.0, meta.top_p)

    def keep_above_cut():
        bits = _ordered_bits(scaled)  # [R, V]
        cut = _top_k_top_p_cut(scaled, bits, top_k, top_p)
        return jnp.where(bits >= cut[:, None], scaled, -jnp.inf)

    # With no row filtering, the two passes over [R, V] that cutting takes are skipped too.
    filtering = jnp.any(jnp.logical_or(*_filters_on(top_k, top_p, scaled.shape[-1])))
    scaled = jax.lax.cond(filtering, keep_above_cut, lambda: scaled)

    keys = jax.random.wrap_key_data(jnp.asarray(meta.keys, jnp.uint32), impl="threefry2x32")
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)  # [R]
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # [R, V], 0 where filtered
    # The first index whose running sum exceeds u * total: a filtered (zero-weight) token can never be it.
    token = _inverse_cdf(weights, uniform)
    # u * total can round up to the total: never step past the last token that has weight.
    last_kept = jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[-1], dtype=jnp.int32), 0), axis=-1)
    return jnp.minimum(token, last_kept).astype(jnp.int32)


def _sample(logits: jax.Array, meta: SamplingMetadata, adjust: LogitsAdjustment | None,
            num_logprobs: int | None) -> SampleResult:
    logits = logits.astype(jnp.float32)  # [R, V]
    rows = logits.shape[0]
    shaped = logits if adjust is None else adjust_logits(logits, adjust)  # logprobs stay those of the raw logits
    greedy = meta.temperature < GREEDY_TEMPERATURE  # [R]
    greedy_tokens = jax.lax.cond(jnp.any(greedy), lambda: _argmax(shaped), lambda: jnp.zeros(rows, jnp.int32))
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: greedy_tokens,
        lambda: jnp.where(greedy, greedy_tokens, _random_tokens(shaped, meta, greedy)),
    )
    if num_logprobs is None:  # no row wants logprobs: the tokens alone
        none = jnp.zeros((rows, 0))
        return SampleResult(tokens, jnp.zeros(rows), none.astype(jnp.int32), none, jnp.zeros(rows, jnp.int32))

    top = jnp.max(logits, axis=-1, keepdims=True)
    log_norm = (top + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)))[:, 0]  # [R]
    sampled_logit = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    sampled_logprob = sampled_logit - log_norm
    sampled_rank = 1 + jnp.sum(logits > sampled_logit[:, None], axis=-1, dtype=jnp.int32)
    if num_logprobs > 0:
        top_values, top_ids = jax.lax.top_k(logits, num_logprobs)  # [R, N]
    else:
        top_values, top_ids = jnp.zeros((rows, 0)), jnp.zeros((rows, 0))
    top_logprobs = (top_values - log_norm[:, None]).astype(jnp.float32)
    return SampleResult(tokens, sampled_logprob, top_ids.astype(jnp.int32), top_logprobs, sampled_rank)


_sample_jit = jax.jit(_sample, static_argnames=("num_logprobs",))


def sample(logits: jax.Array, meta: SamplingMetadata, num_logprobs: int | None = None,
           adjust: LogitsAdjustment | None = None) -> SampleResult:
    """One token per row of ``logits`` [R, V] (jitted per ``num_logprobs`` and the adjustment's widths).

    ``num_logprobs`` (static) is how many top raw logprobs to return per row; use the largest any
    row asked for (bucket it to bound recompiles). None: no row wants logprobs, so only ``tokens`` is
    computed (the other fields are zeros, and the top-N ones empty). ``adjust``: the rows' logits shaping
    (``LogitsAdjustment.build``; None: none)."""
    return _sample_jit(logits, meta, adjust, num_logprobs=num_logprobs)


def to_sampler_output(
    step_id: int,
    request_ids: Sequence[str],
    result: SampleResult,
    num_rows_used: int,
    logprobs_wanted: Sequence[int | None],
    keep: Sequence[int] | None = None,
) -> SamplerOutput:
    """Host ``SamplerOutput`` for the first ``num_rows_used`` rows (one entry per row), or only the rows ``keep``
    names (in that order).

    ``logprobs_wanted[i]`` is row i's ``SamplingParams.logprobs``: None gives no logprobs,
    N gives the sampled token's logprob and the top N.
    """
    if len(request_ids) != num_rows_used or len(logprobs_wanted) != num_rows_used:
        raise ValueError(
            f"num_rows_used={num_rows_used} but got {len(request_ids)} request ids and "
            f"{len(logprobs_wanted)} logprobs entries; pass one of each per used row"
        )
    if num_rows_used > result.tokens.shape[0]:
        raise ValueError(f"num_rows_used={num_rows_used} exceeds the {result.tokens.shape[0]} rows sampled")
    available = result.top_ids.shape[-1]
    wanted = [n for n in logprobs_wanted if n is not None]
    if wanted and max(wanted) > available:
        raise ValueError(
            f"a request asked for {max(wanted)} logprobs but sample() computed {available}; "
            f"call sample() with num_logprobs >= {max(wanted)}"
        )
    if wanted:
        tokens, sampled, top_ids, top_logprobs, ranks = jax.device_get(tuple(result))
    else:
        tokens = jax.device_get(result.tokens)
    rows = list(range(num_rows_used)) if keep is None else list(keep)
    tokens = np.asarray(tokens)[rows].tolist()

    logprobs: list[TokenLogprobs | None] = []
    for row in rows:
        if (n := logprobs_wanted[row]) is None:
            logprobs.append(None)
            continue
        top = tuple(zip(top_ids[row, :n].tolist(), top_logprobs[row, :n].tolist(), strict=True))
        logprobs.append(TokenLogprobs(sampled=float(sampled[row]), top=top, rank=int(ranks[row])))
    return SamplerOutput(
        step_id=step_id,
        request_ids=tuple(request_ids[i] for i in rows),
        token_ids=tuple(tokens),
        logprobs=tuple(logprobs),
    )
