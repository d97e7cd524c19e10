"""A free list of integer ids 1..n-1 with id 0 reserved: the shape of both engine pools (state
slots and KV blocks), whose id 0 is the null entry CUDA-graph padding rows point at."""

from __future__ import annotations

from collections import deque


class NullFirstIdPool:
    def __init__(self, size: int, what: str, exhausted_hint: str):
        if size < 2:
            raise ValueError(f"a {what} pool needs the null {what} plus at least one real one; got {size}")
        self.size, self.what, self._hint = size, what, exhausted_hint
        self._free: deque[int] = deque(range(1, size))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        """Real ids (the null id excluded)."""
        return self.size - 1

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"{self.what} pool exhausted ({self._hint})")
        i = self._free.popleft()
        self._used.add(i)
        return i

    def free(self, i: int) -> None:
        if i not in self._used:
            raise RuntimeError(f"{self.what} {i} freed twice or never allocated")
        self._used.remove(i)
        self._free.append(i)

    def reset(self) -> None:
        """Back to the order of a fresh pool (the startup warm-up borrows ids and returns them:
        later requests then get the ids they would have got without it). Refuses while any id
        is still in use: a leak would otherwise go unnoticed."""
        if self._used:
            raise RuntimeError(f"cannot reset the {self.what} pool: {len(self._used)} {self.what}(s) still in use "
                               f"({sorted(self._used)[:8]}); free every one before reset()")
        self._free = deque(range(1, self.size))
