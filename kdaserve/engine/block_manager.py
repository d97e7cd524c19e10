"""The KV-block pool of the full-attention layers: fixed-size blocks of `block_size` token rows,
handed to sequences as their context grows. Block 0 is the null block (never handed out; CUDA-graph
padding rows' block tables point at it).

Prefix caching (engine/prefix_cache): a full block can be registered under the chained hash of its
prefix; a registered block is shared by reference count, and when no sequence holds it any more it
stays cached (evictable, least recently used first) until a new block is needed. Free blocks are
then the truly free and the evictable ones: caching never holds memory a request needs. Without
registrations (prefix caching off, warm-up) this is a plain free list."""

from __future__ import annotations

from collections import OrderedDict

from kdaserve.engine.id_pool import NullFirstIdPool
from kdaserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ids = NullFirstIdPool(num_blocks, "KV block", "call can_grow first")
        self._refs: dict[int, int] = {}           # blocks held by sequences -> how many
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()   # registered, held by none

    @property
    def num_free(self) -> int:
        return self._ids.num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by sequences (cached blocks no one holds count as free)."""
        return self._ids.num_used - len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    @property
    def capacity(self) -> int:
        return self._ids.capacity

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` lacks to hold KV rows for its first `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= self.num_free

    def _take(self) -> int:
        if self._ids.num_free:
            block = self._ids.allocate()
        else:   # the least recently used cached block, forgotten
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.extra_blocks_for(seq, num_tokens)):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            if block not in self._refs:
                raise RuntimeError(f"KV block {block} freed twice or never allocated")
            n = self._refs[block] - 1
            if n:
                self._refs[block] = n
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._ids.free(block)
        seq.block_table = []   # a new list, not clear(): Sequence.block_table_array's cache keys on it
        seq.num_registered_blocks = 0

    # -- prefix caching ---------------------------------------------------------------------

    def register(self, seq: Sequence, hashes: list[bytes], num_full: int) -> None:
        """Register `seq`'s first `num_full` blocks (full, their KV written) under `hashes`. A hash
        already cached keeps its block; the sequence's duplicate stays private."""
        for i in range(seq.num_registered_blocks, num_full):
            h, block = hashes[i], seq.block_table[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h], self._hash_of[block] = block, h
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`."""
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def num_evictable_in(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if b in self._evictable)

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """`seq` (holding no blocks) starts with these cached blocks."""
        assert not seq.block_table, "share() starts a block table"
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
        seq.block_table = list(blocks)
        seq.num_registered_blocks = len(blocks)

    def clear_cache(self) -> None:
        """Forget every cached block no sequence holds."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self._ids.free(block)

    def reset(self) -> None:
        self.clear_cache()
        self._ids.reset()
