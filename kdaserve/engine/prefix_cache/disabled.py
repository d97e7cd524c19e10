"""Prefix caching turned off (`--no-enable-prefix-caching`): the same interface as PrefixCache,
finding nothing and keeping nothing, so the scheduler and the engine have one path."""

from __future__ import annotations

from kdaserve.engine.sequence import Sequence


class NoPrefixCache:
    enabled = False
    in_step = False   # no checkpoints inside a prefill launch

    def begin_step(self) -> None:
        pass

    def should_wait(self, seq: Sequence, running: list[Sequence]) -> bool:
        return False

    def find(self, seq: Sequence) -> None:
        return None

    def count_query(self, seq: Sequence, hit) -> None:
        pass

    def chunk_len(self, seq: Sequence, n: int) -> int:
        return n

    def after_step(self, batch) -> list[tuple[int, int]]:
        return []

    def clear(self) -> None:
        pass

    def stats(self) -> dict:
        return {}
