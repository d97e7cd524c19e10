"""The KV-block pool of the full-attention layers: fixed-size blocks of `block_size` token rows,
handed to sequences as their context grows. Block 0 is the null block (never handed out; CUDA-graph
padding rows' block tables point at it). No prefix caching: a KDA state cannot be shared from a
prefix of blocks, so every sequence owns its blocks outright."""

from __future__ import annotations

from collections import deque

from kdaserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a KV-block pool needs the null block plus at least one block; got num_blocks={num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` lacks to hold KV rows for its first `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.extra_blocks_for(seq, num_tokens)):
            if not self._free:
                raise RuntimeError("KV-block pool exhausted (call can_grow first)")
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            if block not in self._used:
                raise RuntimeError(f"KV block {block} freed twice or never allocated")
            self._used.remove(block)
            self._free.append(block)
        seq.block_table.clear()
