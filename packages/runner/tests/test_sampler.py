"""The sampler against torch (greedy, logprobs) and against exact distributions (filters)."""

import dataclasses

import numpy as np
import pytest
import torch

from pipejax.runner.batch import SamplingParams, TokenLogprobs
from pipejax.runner.sampler import SamplingMetadata, sample, to_sampler_output

ROWS, VOCAB, NUM_LOGPROBS = 16, 32000, 5  # the "real" shape: one compile
DRAWS = 2000  # draws per configuration in the distribution tests
# A small crafted distribution, deliberately not in sorted order.
PROBS = np.array([0.15, 0.4, 0.005, 0.1, 0.25, 0.03, 0.05, 0.015])
SMALL_LOGITS = (np.log(PROBS) + 2.0).astype(np.float32)  # both signs: exercises the bit order

GREEDY = SamplingParams(temperature=0.0)


def _logits(seed: int, rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, (rows, VOCAB)).astype(np.float32)


def _run(logits, rows, step_seed=0, num_rows=ROWS):
    meta = SamplingMetadata.build(rows, num_rows, step_seed)
    return sample(logits, meta, num_logprobs=NUM_LOGPROBS)


def _tokens(logits, rows, step_seed=0, num_rows=ROWS) -> np.ndarray:
    return np.asarray(_run(logits, rows, step_seed, num_rows).tokens)


def test_greedy_is_argmax_like_torch_including_ties():
    logits = _logits(0)
    logits[3, [10, 20, 30]] = logits[3].max() + 1.0  # a tie: the lowest index wins
    tokens = _tokens(logits, [(GREEDY, 0, f"r{i}") for i in range(ROWS)])
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(tokens, torch.argmax(torch.from_numpy(logits), dim=-1).numpy())
    assert tokens[3] == 10


def test_greedy_rows_stay_argmax_next_to_sampled_rows_and_top_k_1_is_greedy():
    logits = _logits(1)
    rows = []
    for i in range(ROWS):
        if i % 3 == 0:
            rows.append((GREEDY, 0, f"g{i}"))
        elif i % 3 == 1:
            rows.append((SamplingParams(temperature=[0.5, 1.0, 3.0, 50.0][i % 4], top_k=1), i, f"k{i}"))
        else:
            rows.append((SamplingParams(temperature=1e-6), i, f"tiny{i}"))  # below vLLM's eps
    tokens = _tokens(logits, rows)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def _renormalized(allowed: list[int], probs=PROBS) -> np.ndarray:
    out = np.zeros_like(probs)
    out[allowed] = probs[allowed]
    return out / out.sum()


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


# (params, expected distribution over the crafted vocab)
FILTER_CASES = [
    # top-k 3 keeps the three most likely tokens: 0.4, 0.25, 0.15
    (SamplingParams(top_k=3), _renormalized([1, 4, 0])),
    # nucleus 0.6: 0.4 alone is < 0.6, so 0.4 and 0.25
    (SamplingParams(top_p=0.6), _renormalized([1, 4])),
    # min-p 0.2: prob >= 0.08
    (SamplingParams(min_p=0.2), _renormalized([1, 4, 0, 3])),
    # vLLM order, min-p first: min-p 0.3 keeps {.4,.25,.15}; renormalized (.5,.3125,.1875)
    # nucleus 0.7 then keeps {.4,.25} (top-p first would keep three)
    (SamplingParams(min_p=0.3, top_p=0.7), _renormalized([1, 4])),
    # top-k before top-p: top-k 2 -> (.615, .385); nucleus 0.6 keeps one (top-p first: two)
    (SamplingParams(top_k=2, top_p=0.6), _renormalized([1])),
    # min-p leaves fewer tokens than top-k asks for: top-k changes nothing
    (SamplingParams(min_p=0.3, top_k=6), _renormalized([1, 4, 0])),
    # top-p just below 1 after top-k: top-k's set
    (SamplingParams(top_k=3, top_p=0.9999999), _renormalized([1, 4, 0])),
    # temperature alone: softmax(logits / T)
    (SamplingParams(temperature=2.0), _softmax(SMALL_LOGITS / 2.0)),
    (SamplingParams(temperature=0.7), _softmax(SMALL_LOGITS / 0.7)),  # unseeded rows
]


@pytest.fixture(scope="module")
def filter_draws():
    rows = []
    for block, (params, _) in enumerate(FILTER_CASES):
        for i in range(DRAWS):
            # Seeded, so a row's key depends only on (seed, output_index); the last case unseeded.
            seed = None if block == len(FILTER_CASES) - 1 else block * DRAWS + i
            rows.append((dataclasses.replace(params, seed=seed), 0, f"b{block}-{i}"))
    logits = np.tile(SMALL_LOGITS, (len(rows), 1))
    meta = SamplingMetadata.build(rows, len(rows), step_seed=11)
    tokens = np.asarray(sample(logits, meta, num_logprobs=NUM_LOGPROBS).tokens)
    return rows, logits, tokens.reshape(len(FILTER_CASES), DRAWS)


@pytest.mark.parametrize("case", range(len(FILTER_CASES)))
def test_filters_keep_allowed_set_and_match_the_distribution(filter_draws, case):
    _, _, tokens = filter_draws
    expected = FILTER_CASES[case][1]
    drawn = tokens[case]
    assert set(drawn.tolist()) <= set(np.flatnonzero(expected).tolist())
    counts = np.bincount(drawn, minlength=len(PROBS))
    support = expected > 0
    want = expected[support] * DRAWS
    chi2 = float(np.sum((counts[support] - want) ** 2 / want))
    # df <= 7; the 1e-4 tail of chi2(7) is ~29.9 (keys are fixed, so this is deterministic).
    assert chi2 < 30.0, (counts, want)


def test_unfiltered_rows_skip_the_filters_with_the_same_tokens(filter_draws):
    rows, logits, tokens = filter_draws
    # Same shape, but only the unfiltered (temperature 2, seeded) rows are real: the filter
    # branches are skipped, and those rows draw exactly what they drew next to filtered rows.
    block = len(FILTER_CASES) - 2  # temperature 2, seeded
    lo, hi = block * DRAWS, (block + 1) * DRAWS
    only = [rows[i] if lo <= i < hi else (GREEDY, 0, "pad") for i in range(len(rows))]
    meta = SamplingMetadata.build(only, len(rows), step_seed=12345)
    alone = np.asarray(sample(logits, meta, num_logprobs=NUM_LOGPROBS).tokens)
    np.testing.assert_array_equal(alone[lo:hi], tokens[block])


def test_seeded_request_reproduces_alone_or_batched_any_step_seed():
    logits = _logits(2)
    params = SamplingParams(temperature=1.0, seed=1234)
    others = [(SamplingParams(temperature=0.8, top_p=0.9), 3, f"o{i}") for i in range(ROWS)]
    for output_index in range(4):
        alone_logits = np.zeros_like(logits)
        alone_logits[0] = logits[5]
        alone = _tokens(alone_logits, [(params, output_index, "s")], step_seed=0)[0]
        batched_rows = others[:5] + [(params, output_index, "s")] + others[6:]
        batched = _tokens(logits, batched_rows, step_seed=99)[5]
        assert alone == batched
    # ... and the key moves with output_index
    flat = np.zeros((ROWS, VOCAB), np.float32)
    per_index = _tokens(flat, [(params, i, "s") for i in range(ROWS)])
    assert len(set(per_index.tolist())) > ROWS // 2


def test_unseeded_requests_differ_across_step_seeds():
    flat = np.zeros((ROWS, VOCAB), np.float32)  # uniform: collisions are ~1/32000
    rows = [(SamplingParams(temperature=1.0), 0, f"u{i}") for i in range(ROWS)]
    a, b = _tokens(flat, rows, step_seed=1), _tokens(flat, rows, step_seed=2)
    assert np.sum(a != b) >= ROWS - 1
    np.testing.assert_array_equal(a, _tokens(flat, rows, step_seed=1))


def test_logprobs_are_raw_log_softmax_like_torch():
    logits = _logits(3)
    rows = [(SamplingParams(temperature=0.5 + i / 8, top_k=50, seed=i), 0, f"r{i}") for i in range(ROWS)]
    result = _run(logits, rows)
    reference = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    top = torch.topk(reference, NUM_LOGPROBS, dim=-1)
    np.testing.assert_array_equal(np.asarray(result.top_ids), top.indices.numpy())
    np.testing.assert_allclose(np.asarray(result.top_logprobs), top.values.numpy(), atol=1e-5, rtol=0)
    tokens = torch.from_numpy(np.array(result.tokens)).long()
    sampled = reference.gather(1, tokens[:, None])[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(result.sampled_logprob), sampled, atol=1e-5, rtol=0)
    # ... and top-k 50 held on the full vocab: every sampled token ranks in the top 50.
    rank = (reference > reference.gather(1, tokens[:, None])).sum(dim=-1)
    assert int(rank.max()) < 50


def test_padding_rows_do_not_affect_real_rows_and_output_is_trimmed():
    real = [
        (SamplingParams(temperature=0.9, top_k=40, seed=7, logprobs=2), 3, "a"),
        (GREEDY, 0, "b"),
        (SamplingParams(temperature=1.3, top_p=0.8, min_p=0.01, logprobs=0), 1, "c"),
    ]
    logits = _logits(4)
    other = _logits(5)
    other[:3] = logits[:3]
    other[3:] *= 100.0  # padding rows hold garbage
    first, second = _run(logits, real, step_seed=3), _run(other, real, step_seed=3)
    for x, y in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(x)[:3], np.asarray(y)[:3])

    out = to_sampler_output(42, ["a", "b", "c"], first, 3, [2, None, 0])
    assert out.step_id == 42 and out.request_ids == ("a", "b", "c")
    assert out.token_ids == tuple(np.asarray(first.tokens)[:3].tolist())
    assert all(isinstance(t, int) for t in out.token_ids)
    a, b, c = out.logprobs
    assert b is None
    assert isinstance(a, TokenLogprobs) and len(a.top) == 2 and c.top == ()
    assert a.top[0][0] == int(np.argmax(logits[0]))
    assert a.sampled == pytest.approx(float(first.sampled_logprob[0]))
    with pytest.raises(ValueError, match="num_logprobs"):
        to_sampler_output(42, ["a"], first, 1, [NUM_LOGPROBS + 1])


def test_build_pads_greedy_and_rejects_overflow():
    meta = SamplingMetadata.build([(SamplingParams(top_k=-1, top_p=0.5), 0, "x")], 4, 0)
    assert meta.top_k.tolist() == [0, 0, 0, 0]
    assert meta.temperature.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert meta.top_p.tolist() == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="num_rows=1"):
        SamplingMetadata.build([(GREEDY, 0, "x"), (GREEDY, 0, "y")], 1, 0)


def test_bisection_cut_keeps_the_same_set_as_a_sort():
    from pipejax.runner.sampler import _ordered_bits, _top_k_top_p_cut

    rng = np.random.default_rng(6)
    scaled = rng.normal(0.0, 2.0, (8, VOCAB)).astype(np.float32)
    scaled[1, rng.choice(VOCAB, 20000, replace=False)] = -np.inf  # min-p already applied
    top_k = np.array([0, 40, 1, 0, 500, 7, 31999, 0], np.int32)
    top_p = np.array([0.9, 0.5, 1.0, 1.0, 0.95, 1e-6, 0.3, 0.99], np.float32)
    bits = _ordered_bits(scaled)
    kept = np.asarray(bits >= _top_k_top_p_cut(scaled, bits, top_k, top_p)[:, None])
    for row in range(8):
        ordered = np.sort(scaled[row])[::-1]
        keep = np.ones(VOCAB, bool)
        if 0 < top_k[row] < VOCAB:
            keep &= scaled[row] >= ordered[top_k[row] - 1]
        if top_p[row] < 1:
            values = np.where(ordered >= scaled[row][keep].min(), ordered, -np.inf).astype(np.float64)
            probs = np.exp(values - values[0])
            probs /= probs.sum()
            num = max(int(np.sum(np.cumsum(probs) - probs < top_p[row])), 1)
            keep &= scaled[row] >= ordered[num - 1]
        np.testing.assert_array_equal(kept[row], keep, err_msg=f"row {row}")


@pytest.mark.parametrize("vocab", [32000, 1000, 128 * 3 + 1])
def test_two_level_argmax_and_inverse_cdf_match_numpy(vocab):
    """The blockwise argmax and running sum agree with numpy's, padded tails and block edges included."""
    from pipejax.runner.sampler import _argmax, _inverse_cdf

    rng = np.random.default_rng(vocab)
    logits = rng.normal(0.0, 3.0, (6, vocab)).astype(np.float32)
    logits[1, [127, 128, vocab - 1]] = 99.0  # a tie across a block edge: the lowest index wins
    logits[2, vocab - 1] = 99.0  # the max in the padded last block
    np.testing.assert_array_equal(np.asarray(_argmax(logits)), np.argmax(logits, axis=-1))

    # Small integer weights: every running sum is exact in fp32, so the counts must agree exactly.
    weights = rng.integers(0, 4, (6, vocab)).astype(np.float32)
    weights[3, :] = 0.0
    weights[3, [5, vocab - 1]] = 1.0  # two tokens at the ends
    uniform = np.array([0.0, 0.25, 0.5, 0.5, 0.999, 1.0], np.float32)
    cdf = np.cumsum(weights, axis=-1)
    expected = np.sum(cdf <= (uniform * cdf[:, -1])[:, None], axis=-1)
    np.testing.assert_array_equal(np.asarray(_inverse_cdf(weights, uniform)), expected)


def test_no_logprobs_wanted_gives_the_same_tokens():
    logits = _logits(7)
    rows = [(SamplingParams(temperature=1.0, seed=i), 0, f"r{i}") for i in range(ROWS)]
    meta = SamplingMetadata.build(rows, ROWS, 0)
    bare = sample(logits, meta, num_logprobs=None)
    np.testing.assert_array_equal(np.asarray(bare.tokens), np.asarray(sample(logits, meta, num_logprobs=0).tokens))
    assert bare.top_ids.shape == (ROWS, 0)
    out = to_sampler_output(0, [f"r{i}" for i in range(ROWS)], bare, ROWS, [None] * ROWS)
    assert out.token_ids == tuple(np.asarray(bare.tokens).tolist())


def _vllm_reference(logits: np.ndarray, request) -> np.ndarray:
    """vLLM v1's logits shaping for one request, in numpy: allowed ids, bad words (their prefix must end the
    output), min_tokens, logit_bias, then the repetition (prompt and output), frequency and presence penalties."""

    p, x = request.sampling, logits.astype(np.float64).copy()
    history = list(request.history or ())
    outputs = history[len(history) - request.output_index:]
    if p.allowed_token_ids is not None:
        keep = np.zeros(x.size, bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in p.bad_words_token_ids:
        if len(word) == 1 or (len(word) - 1 <= len(outputs) and tuple(outputs[-(len(word) - 1):]) == word[:-1]):
            x[word[-1]] = -np.inf
    if request.output_index < p.min_tokens:
        x[list(p.min_tokens_stop_ids)] = -np.inf
    for token, bias in p.logit_bias:
        x[token] += bias
    if history:
        seen = np.zeros(x.size, bool)
        seen[history] = True
        x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
        counts = np.bincount(outputs, minlength=x.size)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x


def test_logits_adjustment_is_vllms_per_row():
    """Each row shaped as vLLM would, rows that ask nothing untouched, padding rows dropped; a batch where no row
    asks builds nothing (the plain sampler program runs)."""
    from pipejax.runner.batch import ScheduledRequest
    from pipejax.runner.logits_adjustment import LogitsAdjustment
    from pipejax.runner.logits_adjustment import adjust_logits as _adjust

    vocab = 64
    plain = ScheduledRequest("plain", (1,), 0, (1,), GREEDY)
    assert LogitsAdjustment.build([plain, plain], 4, vocab) is None
    history = (5, 9, 9, 3, 7, 9, 12, 3)  # 5 prompt tokens, then 3 outputs: 9, 12, 3
    asks = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=-0.3),
        SamplingParams(logit_bias={4: 2.5, 60: -100.0}, allowed_token_ids=(4, 9, 12, 33, 60)),
        SamplingParams(bad_words_token_ids=((20,), (12, 3, 40), (9, 41), (3, 5, 8))),  # (3, 5, 8): prompt only
        SamplingParams(min_tokens=4, min_tokens_stop_ids=(2, 7), logit_bias={2: 1.0}),
        SamplingParams(min_tokens=3, min_tokens_stop_ids=(2, 7)),  # reached: nothing banned
    ]
    requests = [ScheduledRequest(f"r{i}", (3,), 7, (1,), p, output_index=3,
                                 history=history if p.needs_history else None) for i, p in enumerate(asks)]
    requests.append(plain)
    logits = np.random.default_rng(0).normal(0, 3, (8, vocab)).astype(np.float32)
    adj = LogitsAdjustment.build(requests, 8, vocab)
    got = np.asarray(_adjust(logits, adj))
    for row, request in enumerate(requests):
        np.testing.assert_allclose(got[row], _vllm_reference(logits[row], request), rtol=1e-6, err_msg=str(row))
    np.testing.assert_array_equal(got[len(requests):], logits[len(requests):])
    assert np.isneginf(got[2, [20, 40]]).all() and not np.isneginf(got[2, [41, 8]]).any()
    assert np.isneginf(got[3, [2, 7]]).all() and not np.isneginf(got[4]).any()


def test_token_bitmask_limits_only_its_row():
    """A structured output's bitmask (vLLM's layout: bit t % 32 of i32 word t // 32) leaves exactly its tokens to
    its row, tokens past the mask's words are refused, and rows without a mask keep their logits."""
    from pipejax.runner.batch import ScheduledRequest
    from pipejax.runner.logits_adjustment import LogitsAdjustment
    from pipejax.runner.logits_adjustment import adjust_logits as _adjust

    vocab = 70  # three words, the last one partial
    allowed = {0, 5, 31, 32, 63}  # the mask covers two words: 64..69 lie past it
    words = np.zeros(2, np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    requests = [ScheduledRequest(f"r{i}", (1,), 0, (1,), GREEDY) for i in range(3)]
    logits = np.random.default_rng(1).normal(0, 3, (4, vocab)).astype(np.float32)
    adj = LogitsAdjustment.build(requests, 4, vocab, {"r1": words.view(np.int32)})
    got = np.asarray(_adjust(logits, adj))
    assert set(np.flatnonzero(np.isfinite(got[1]))) == allowed
    np.testing.assert_array_equal(got[1, sorted(allowed)], logits[1, sorted(allowed)])
    np.testing.assert_array_equal(got[[0, 2, 3]], logits[[0, 2, 3]])
    meta = SamplingMetadata.build([(GREEDY, 0, r.request_id) for r in requests], 4, 0)
    tokens = np.asarray(sample(logits, meta, num_logprobs=None, adjust=adj).tokens)
    assert tokens[1] == max(allowed, key=lambda t: logits[1, t])
    np.testing.assert_array_equal(tokens[[0, 2]], logits[[0, 2]].argmax(-1))
