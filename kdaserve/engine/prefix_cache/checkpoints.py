"""KDA state checkpoints: a fixed set of state slots (after the running requests' slots) holding
copies of states at prefix boundaries, found by the hash of the block that ends there, evicted
least recently used. Running requests never wait for them: their own slots are apart."""

from __future__ import annotations

from collections import OrderedDict, deque


class StateCheckpoints:
    def __init__(self, first_slot: int, count: int):
        self.capacity = count
        self._free: deque[int] = deque(range(first_slot, first_slot + count))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached slots, least recently used first
        self.pinned: set[int] = set()   # slots a restore of the current step reads: not evicted
        # Slots the current step's prefill writes (taken before its forward pass): not found by
        # lookups (nothing is in them yet) and not evicted, until after_step clears the set.
        self.pending: set[int] = set()

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: bytes) -> int | None:
        slot = self._by_hash.get(key)
        if slot is None or slot in self.pending:
            return None
        self._lru.move_to_end(slot)
        return slot

    def take(self, key: bytes, pending: bool = False) -> int | None:
        """A slot to copy the state at `key` into, or None when `key` is cached already or every
        cached slot is pinned or pending. `pending`: the step about to run writes it."""
        if key in self._by_hash:
            self._lru.move_to_end(self._by_hash[key])
            return None
        if self._free:
            slot = self._free.popleft()
        else:
            slot = next((s for s in self._lru if s not in self.pinned and s not in self.pending), None)
            if slot is None:
                return None
            self._drop(slot)
            self._free.remove(slot)
        self._by_hash[key], self._hash_of[slot] = slot, key
        self._lru[slot] = None
        if pending:
            self.pending.add(slot)
        return slot

    def drop(self, key: bytes, *, untake: bool = False) -> None:
        """Forget `key` unless a restore reads it or the step writes it; `untake`: a pending slot
        the step will not write after all (taken and dropped before its forward pass)."""
        slot = self._by_hash.get(key)
        if slot is None or slot in self.pinned or (slot in self.pending and not untake):
            return
        self.pending.discard(slot)
        self._drop(slot)

    def _drop(self, slot: int) -> None:
        del self._by_hash[self._hash_of.pop(slot)]
        del self._lru[slot]
        self._free.append(slot)

    def clear(self) -> None:
        for slot in list(self._lru):
            self._drop(slot)
