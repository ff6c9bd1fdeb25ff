"""Turn a ``ModelBatch`` into padded host arrays, choosing padding buckets so that a steady
workload reuses a bounded set of compiled shapes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipejax.runner.batch import ModelBatch
from pipejax.runner.model import StepInputs


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
    """Padding sizes for tokens (T), rows (R), query length (Q) and blocks per row (B)."""

    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    query: tuple[int, ...]
    blocks: tuple[int, ...]

    @classmethod
    def make(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> Buckets:
        max_tokens = 2 ** math.ceil(math.log2(max(max_num_batched_tokens, max_num_seqs)))
        max_blocks = math.ceil(max_model_len / block_size)
        return cls(
            tokens=_powers_of_two(min(16, max_tokens), max_tokens),
            rows=_powers_of_two(min(8, max_num_seqs), max_num_seqs),
            query=_powers_of_two(1, max_tokens),
            blocks=_powers_of_two_and_halves(min(max(1, 64 // block_size), max_blocks), max_blocks),
        )

    def shape_of(self, batch: ModelBatch, block_size: int) -> tuple[int, int, int, int]:
        """(T, R, Q, B) for ``batch``."""
        reqs = batch.requests
        T = pick(self.tokens, batch.num_tokens, "tokens in the step")
        R = pick(self.rows, len(reqs), "requests in the step")
        Q = pick(self.query, max(len(r.token_ids) for r in reqs), "query tokens of one request")
        Q = min(Q, T)
        needed = max(math.ceil(r.end_position / block_size) for r in reqs)
        B = pick(self.blocks, needed, "KV blocks of one request")
        return T, R, Q, B

    def count(self) -> int:
        return len(self.tokens) * len(self.rows) * len(self.query) * len(self.blocks)


def build_step_inputs(batch: ModelBatch, shape: tuple[int, int, int, int], block_size: int) -> StepInputs:
    """Host (numpy) arrays for the padded step; padding tokens write to the reserved block 0."""
    T, R, Q, B = shape
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)
    token_row = np.zeros(T, np.int32)
    token_col = np.zeros(T, np.int32)
    row_query_start = np.zeros(R, np.int32)
    row_query_len = np.zeros(R, np.int32)
    row_start_pos = np.zeros(R, np.int32)
    block_tables = np.zeros((R, B), np.int32)
    sample_index = np.zeros(R, np.int32)
    t = 0
    for row, req in enumerate(batch.requests):
        n = len(req.token_ids)
        if n == 0:
            raise ValueError(f"request {req.request_id!r} has no tokens to compute in step {batch.step_id}")
        needed = math.ceil(req.end_position / block_size)
        if len(req.block_table) < needed:
            raise ValueError(
                f"request {req.request_id!r} reaches position {req.end_position} but its block table holds "
                f"{len(req.block_table)} blocks of {block_size}; the scheduler must allocate {needed}"
            )
        table = np.asarray(req.block_table[:needed], np.int32)
        pos = np.arange(req.start_position, req.end_position, dtype=np.int32)
        token_ids[t : t + n] = req.token_ids
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = table[pos // block_size] * block_size + pos % block_size
        token_row[t : t + n] = row
        token_col[t : t + n] = np.arange(n)
        row_query_start[row] = t
        row_query_len[row] = n
        row_start_pos[row] = req.start_position
        block_tables[row, :needed] = table
        sample_index[row] = t + n - 1
        t += n
    return StepInputs(
        token_ids,
        positions,
        slot_mapping,
        token_row,
        token_col,
        row_query_start,
        row_query_len,
        row_start_pos,
        block_tables,
        sample_index,
    )
