"""Step shapes and the padded inputs of a ragged batch (host side only)."""

import numpy as np
import pytest

from pipejax.runner.batch import ModelBatch, ScheduledRequest
from pipejax.runner.inputs import MIN_PREFILL_SLOTS, Buckets, build_step_inputs
from pipejax.runner.step_inputs import StepShape

BLOCK = 16
BUCKETS = Buckets.make(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024, block_size=BLOCK)


def request(i: int, n: int, start: int) -> ScheduledRequest:
    blocks = -(-(start + n) // BLOCK)
    return ScheduledRequest(f"r{i}", tuple(range(1, n + 1)), start, tuple(range(1 + 100 * i, 1 + 100 * i + blocks)))


def test_decode_only_step_has_no_prefill_group():
    batch = ModelBatch(0, tuple(request(i, 1, 40) for i in range(5)))
    assert BUCKETS.shape_of(batch, BLOCK) == StepShape(tokens=8, prefill_rows=0, query=1, decode_rows=8, blocks=4)


def test_decode_step_of_one_request_pads_nothing():
    """One decode row: one token, one row for the LM head and the sampler (not the 16 x 8 of a prefill bucket)."""
    batch = ModelBatch(0, (request(0, 1, 40),))
    assert BUCKETS.shape_of(batch, BLOCK) == StepShape(tokens=1, prefill_rows=0, query=1, decode_rows=1, blocks=4)


def test_mixed_step_prefill_group_reads_only_the_blocks_its_contexts_need():
    """A decode row deep in its context sets B; the prefill rows beside it read their own bucket (Bp)."""
    reqs = (request(0, 1, 500), request(1, 100, 0), request(2, 30, 16))
    shape = BUCKETS.shape_of(ModelBatch(0, reqs), BLOCK)
    assert (shape.blocks, shape.prefill_blocks) == (32, 8)  # 501 positions: 32 blocks; 100: 7 -> bucket 8
    inp = build_step_inputs(ModelBatch(0, reqs), shape, BLOCK)
    assert list(inp.block_tables[0, :7]) == list(reqs[1].block_table) and inp.block_tables.shape[1] == 32
    # the same prefill rows alone, or beside decode rows as deep as they are: one block width, Bp = 0
    assert BUCKETS.shape_of(ModelBatch(0, reqs[1:]), BLOCK).prefill_blocks == 0
    assert BUCKETS.shape_of(ModelBatch(0, (request(0, 1, 90), *reqs[1:])), BLOCK).prefill_blocks == 0


def test_mixed_step_pads_decode_group_to_the_largest_bucket_and_short_chunks_to_min_slots():
    reqs = (request(0, 1, 40), request(1, 100, 0), request(2, 1, 70), request(3, 30, 16))
    shape = BUCKETS.shape_of(ModelBatch(0, reqs), BLOCK)
    assert shape == StepShape(tokens=256, prefill_rows=MIN_PREFILL_SLOTS // 128, query=128, decode_rows=64, blocks=8)

    inp = build_step_inputs(ModelBatch(0, reqs), shape, BLOCK)
    P, Q = shape.prefill_rows, shape.query
    # prefill requests take attention rows 0, 1 in order, right-aligned in their Q slots (100 and 30
    # tokens: 28 and 98 padding slots first, so the rows' slot 0 lies before their first token);
    # decode requests rows P, P + 1
    assert list(inp.row_query_start[[0, 1, P, P + 1]]) == [1 - 28, 102 - 98, 0, 101]
    assert list(inp.row_start_pos[[0, 1, P, P + 1]]) == [0 - 28, 16 - 98, 40, 70]
    # each token's attention output: prefill row r, slot s -> r * Q + s; decode row d -> P * Q + d
    assert inp.token_out[0] == P * Q and inp.token_out[101] == P * Q + 1
    assert list(inp.token_out[1:4]) == [28, 29, 30] and list(inp.token_out[102:104]) == [Q + 98, Q + 99]
    assert inp.token_out[100] == Q - 1 and inp.token_out[131] == 2 * Q - 1  # each prompt's last token
    # logits rows stay in the batch's request order
    assert list(inp.sample_index[:4]) == [0, 100, 101, 131]
    assert np.all(inp.block_tables[P, :3] == [1, 2, 3])


def test_long_prompt_is_not_padded_to_more_rows():
    shape = BUCKETS.shape_of(ModelBatch(0, (request(0, 500, 0),)), BLOCK)
    assert (shape.prefill_rows, shape.query, shape.decode_rows) == (1, 512, 0)


def test_more_prefill_requests_than_the_largest_bucket_is_an_error():
    small = Buckets.make(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=1024, block_size=BLOCK)
    with pytest.raises(ValueError, match="prefill requests in the step=5 exceeds the largest bucket 4"):
        small.shape_of(ModelBatch(0, tuple(request(i, 2, 0) for i in range(5))), BLOCK)


def test_prefill_chunks_cover_every_slot_and_each_real_token_sees_its_context():
    """A right-aligned row's real tokens all find the positions they attend to inside their chunk's context."""
    from pipejax.runner.model import prefill_chunks

    for query, context in [(128, 128), (128, 192), (256, 192), (16, 64), (2048, 2048), (1, 16)]:
        chunks = prefill_chunks(query, context)
        assert [lo for lo, _, _ in chunks] == [0] + [hi for _, hi, _ in chunks[:-1]] and chunks[-1][1] == query
        assert all(1 <= c_hi <= context for _, _, c_hi in chunks)
        for n in {1, min(query, context) // 2, min(query, context)}:  # a row of n tokens ending at `end`
            for end in {n, context}:
                for lo, hi, c_hi in chunks:
                    for slot in range(max(lo, query - n), hi):
                        assert end - query + slot < c_hi, (query, context, n, end, slot)
    assert prefill_chunks(128, 128)[0] == (0, 32, 32)  # the causal triangle: the first chunk sees 32 slots
    assert prefill_chunks(16, 64) == [(0, 16, 64)]  # chunks of at least 16 slots
