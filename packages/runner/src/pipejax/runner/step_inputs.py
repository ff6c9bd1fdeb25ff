"""The shape of one padded ragged step (``StepShape``: static, each distinct value compiles once) and the device
arrays that describe it (``StepInputs``): what ``inputs.py`` builds from a batch and ``model.stage_forward`` reads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class StepShape(NamedTuple):
    """The padded shape of one step (static: each distinct value compiles once).

    Attention rows come in two groups: ``prefill_rows`` rows whose query is padded to ``query``
    tokens (dense attention), then ``decode_rows`` rows of exactly one query token (attention that
    streams the paged K/V once). A decode row in a mixed step is not padded to the longest chunk.
    """

    tokens: int  # T
    prefill_rows: int  # P (0: no prefill rows)
    query: int  # Q: the longest prefill query (1 when P == 0)
    decode_rows: int  # Rd (0: no decode rows)
    blocks: int  # B: block-table columns per row
    # Bp: the columns a prefill row reads when its context needs fewer than B (0: all B). In a mixed step B is set
    # by the decode rows' longer contexts; the prefill group's dense attention then scores only Bp blocks (the
    # benchmark's 16 x 128-token prefills beside 64 decode rows: 8 blocks, not 12).
    prefill_blocks: int = 0
    # the last stage also returns every token's final hidden states [T, E] (for prompt logprobs)
    prompt_hidden: bool = False

    @property
    def rows(self) -> int:
        """Attention rows, and the rows the LM head and the sampler run on (P + Rd)."""
        return self.prefill_rows + self.decode_rows


class StepInputs(NamedTuple):
    """Device arrays describing one padded ragged step (built by ``inputs.py``). Rows [0, P) are the
    prefill group, rows [P, P + Rd) the decode group; ``sample_index`` is in the batch's request order."""

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32: cache slot each token's K/V is written to (padding -> slot 0)
    token_out: jax.Array  # [T] int32: the token's index in the attention output [P * Q + Rd]
    row_query_start: jax.Array  # [P + Rd] int32: flat index of the row's first query slot (see below)
    row_start_pos: jax.Array  # [P + Rd] int32: position of the row's first query slot this step
    # A prefill row is right-aligned in its Q query slots (its last token in slot Q - 1), so for a row of
    # n < Q tokens both fields point n - Q before its first token (negative values are padding slots).
    block_tables: jax.Array  # [P + Rd, B] int32 (padding -> block 0)
    sample_index: jax.Array  # [P + Rd] int32: flat index of request i's last token (logits are taken there)
