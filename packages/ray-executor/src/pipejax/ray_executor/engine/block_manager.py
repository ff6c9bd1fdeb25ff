"""Paged KV block accounting: which block ids each request holds. Block 0 is never handed out
(the runner writes padding tokens there)."""

from __future__ import annotations

import math
from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_needed(self, held: int, num_tokens: int) -> int:
        """Additional blocks a request holding ``held`` blocks needs to store ``num_tokens`` tokens."""
        return max(0, math.ceil(num_tokens / self.block_size) - held)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place to cover ``num_tokens``; False (and no change) if blocks run out."""
        need = self.blocks_needed(len(block_ids), num_tokens)
        if need > len(self._free):
            return False
        block_ids.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
        block_ids.clear()
