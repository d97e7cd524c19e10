"""A draft proposer for tests and benchmarks of speculative decoding: drafts taken from outputs
known in advance (a plain run's), so every acceptance length can be forced."""

from __future__ import annotations

from collections.abc import Callable


class ScriptedProposer:
    """Proposes the next min(k, room) tokens of the request's known output (keyed by its prompt);
    where `wrong(call)` names a position (0-based, or None), that draft is replaced by another
    token, so acceptance stops exactly there. Stands in for the engine's proposer."""

    def __init__(self, outputs: dict[tuple, list[int]], k: int, wrong: Callable[[int], int | None] = lambda call: None,
                 vocab_size: int = 250):
        self.outputs, self.k, self.wrong, self.vocab_size = outputs, k, wrong, vocab_size
        self.calls = 0

    def propose(self, seq, room: int) -> list[int]:
        done = seq.num_output_tokens
        drafts = list(self.outputs[tuple(seq.prompt_token_ids)][done : done + min(self.k, room)])
        bad = self.wrong(self.calls)
        self.calls += 1
        if bad is not None and bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % self.vocab_size
        return drafts

    def forget(self, seq) -> None:
        pass
