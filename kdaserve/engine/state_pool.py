"""The state-slot pool: one slot per running request, shared by all KDA layers (each layer's
conv and recurrent caches are `[num_slots, ...]`). Slot 0 is the null slot: never handed out, it
is what CUDA-graph padding rows point at, and kernels skip it."""

from __future__ import annotations

from collections import deque


class StateSlotPool:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"a state-slot pool needs the null slot plus at least one real slot; got num_slots={num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        """Real slots (the null slot excluded)."""
        return self.num_slots - 1

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("state-slot pool exhausted (the scheduler admits at most max_num_seqs requests)")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)
