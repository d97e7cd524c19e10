"""The KV-block pool of the full-attention layers: fixed-size blocks of `block_size` token rows,
handed to sequences as their context grows. Block 0 is the null block (never handed out; CUDA-graph
padding rows' block tables point at it). No prefix caching: a KDA state cannot be shared from a
prefix of blocks, so every sequence owns its blocks outright."""

from __future__ import annotations

from kdaserve.engine.id_pool import NullFirstIdPool
from kdaserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ids = NullFirstIdPool(num_blocks, "KV block", "call can_grow first")

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    @property
    def num_used(self) -> int:
        return self._ids.num_used

    @property
    def capacity(self) -> int:
        return self._ids.capacity

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` lacks to hold KV rows for its first `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= self._ids.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.extra_blocks_for(seq, num_tokens)):
            seq.block_table.append(self._ids.allocate())

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self._ids.free(block)
        seq.block_table = []   # a new list, not clear(): Sequence.block_table_array's cache keys on it

    def reset(self) -> None:
        self._ids.reset()
