"""Turn a ``ModelBatch`` into padded host arrays, choosing padding buckets so that a steady
workload reuses a bounded set of compiled shapes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipejax.runner.batch import ModelBatch
from pipejax.runner.step_inputs import StepInputs, StepShape

MIN_PREFILL_SLOTS = 512  # prefill rows x query slots a step pads up to (see Buckets.shape_of)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= 2
    return tuple(out) + (hi,)


def _powers_of_two_and_halves(lo: int, hi: int) -> tuple[int, ...]:
    """lo, ..., 4, 6, 8, 12, 16, 24, ... up to hi: attention cost grows with the padded context,
    so context buckets step by 1.5x/1.33x rather than 2x."""
    out = {b for p in _powers_of_two(1, max(hi, 1)) for b in (p, p + p // 2) if lo <= b <= hi}
    return tuple(sorted(out | {lo, hi}))


def pick(buckets: tuple[int, ...], n: int, what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}; raise the matching limit")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padding sizes for tokens (T), prefill rows (P), prefill query length (Q), decode rows (Rd)
    and blocks per row (B)."""

    tokens: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    query: tuple[int, ...]
    rows: tuple[int, ...]  # decode rows (from 1: a decode step reads every weight whatever its rows, but
    # XLA:CPU's matmuls over 8-16 padded rows cost 2-3x one row's, and so do the LM head and sampler)
    blocks: tuple[int, ...]

    @classmethod
    def make(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> Buckets:
        max_tokens = 2 ** math.ceil(math.log2(max(max_num_batched_tokens, max_num_seqs)))
        max_blocks = math.ceil(max_model_len / block_size)
        return cls(
            tokens=_powers_of_two(min(16, max_tokens), max_tokens),
            prefill_rows=_powers_of_two(1, max_num_seqs),
            query=_powers_of_two(1, max_tokens),
            rows=_powers_of_two(1, max_num_seqs),
            blocks=_powers_of_two_and_halves(min(max(1, 64 // block_size), max_blocks), max_blocks),
        )

    def shape_of(self, batch: ModelBatch, block_size: int) -> StepShape:
        reqs = batch.requests
        prefill = [len(r.token_ids) for r in reqs if len(r.token_ids) > 1]
        num_decode = len(reqs) - len(prefill)
        if prefill:
            T = pick(self.tokens, batch.num_tokens, "tokens in the step")
        else:  # a decode step: one token per row, no padding tokens beyond the padded rows
            T = pick(self.rows, num_decode, "decode requests in the step")
        Q = min(pick(self.query, max(prefill), "query tokens of one request"), T) if prefill else 1
        # Short chunks pad their row count up to MIN_PREFILL_SLOTS query slots: the dense block stays
        # small, and far fewer (rows, query) pairs exist to compile when timing decides the mix.
        P = pick(self.prefill_rows, max(len(prefill), min(MIN_PREFILL_SLOTS // Q, self.prefill_rows[-1])),
                 "prefill requests in the step") if prefill else 0
        if not num_decode:
            Rd = 0
        elif prefill:
            # Mixed step: the decode group takes the largest bucket. Its attention is cheap next to the
            # prefill's, and mixed shapes then vary only as the prefill group does (which requests mix
            # in a step depends on timing, so every extra combination would compile in the middle of a run).
            Rd = self.rows[-1]
        else:
            Rd = pick(self.rows, num_decode, "decode requests in the step")
        needed = [math.ceil(r.end_position / block_size) for r in reqs]
        B = pick(self.blocks, max(needed), "KV blocks of one request")
        Bp = 0  # the prefill group of a mixed step reads only the blocks its own contexts need (0: all B)
        if prefill and num_decode:
            deepest = max(n for n, r in zip(needed, reqs, strict=True) if len(r.token_ids) > 1)
            Bp = pick(self.blocks, deepest, "KV blocks of one request")
        return StepShape(T, P, Q, Rd, B, Bp if Bp < B else 0, any(r.prompt_targets for r in reqs))

    def count(self) -> int:
        """An upper bound on the distinct step shapes."""
        groups = (len(self.prefill_rows) + 1) * len(self.query) * (len(self.rows) + 1)
        return (len(self.tokens) * groups * len(self.blocks) + len(self.rows)) * len(self.blocks)  # (Bp, B) pairs


def build_step_inputs(batch: ModelBatch, shape: StepShape, block_size: int) -> StepInputs:
    """Host (numpy) arrays for the padded step; padding tokens write to the reserved block 0.

    Requests keep their order in the token stream and in ``sample_index``; their attention rows are
    grouped: prefill requests (more than one query token) in rows [0, P), right-aligned in their Q query
    slots (``model.prefill_attention`` relies on it), decode requests after P."""
    T, P, Q, B = shape.tokens, shape.prefill_rows, shape.query, shape.blocks
    R = shape.rows
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)
    token_out = np.zeros(T, np.int32)
    row_query_start = np.zeros(R, np.int32)
    row_start_pos = np.zeros(R, np.int32)
    block_tables = np.zeros((R, B), np.int32)
    sample_index = np.zeros(R, np.int32)
    t, next_prefill, next_decode = 0, 0, P
    for i, req in enumerate(batch.requests):
        n = len(req.token_ids)
        if n == 0:
            raise ValueError(f"request {req.request_id!r} has no tokens to compute in step {batch.step_id}")
        needed = math.ceil(req.end_position / block_size)
        if len(req.block_table) < needed:
            raise ValueError(
                f"request {req.request_id!r} reaches position {req.end_position} but its block table holds "
                f"{len(req.block_table)} blocks of {block_size}; the scheduler must allocate {needed}"
            )
        pad = 0  # query slots before the row's first token (prefill rows are right-aligned)
        if n > 1:
            row, next_prefill = next_prefill, next_prefill + 1
            pad = Q - n
            token_out[t : t + n] = row * Q + pad + np.arange(n)
        else:
            row, next_decode = next_decode, next_decode + 1
            token_out[t] = P * Q + row - P
        table = np.asarray(req.block_table[:needed], np.int32)
        pos = np.arange(req.start_position, req.end_position, dtype=np.int32)
        token_ids[t : t + n] = req.token_ids
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = table[pos // block_size] * block_size + pos % block_size
        row_query_start[row] = t - pad
        row_start_pos[row] = req.start_position - pad
        block_tables[row, :needed] = table
        sample_index[i] = t + n - 1
        t += n
    return StepInputs(
        token_ids, positions, slot_mapping, token_out, row_query_start, row_start_pos, block_tables, sample_index
    )
