"""Drafts from the model's multi-token-prediction layer (speculative method "mtp").

The model runner runs the MTP layer after every step's target forward, over the step's rows with
the tokens that follow them (speculative/mtp_drafter.py), which keeps the layer's own
attention caches filled for every computed position; the row of a sequence's newest token gives
its draft for the next verify step. This proposer only holds those drafts between the step that
made them and the verify that checks them: a draft is used only while the sequence is as long as
when it was made (a preemption or a finished request drops it)."""

from __future__ import annotations

from kdaserve.engine.sequence import Sequence


class MtpProposer:
    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self._drafts: dict[int, tuple[int, list[int]]] = {}   # seq_id -> (length it continues, drafts)

    def set_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        self._drafts[seq.seq_id] = (len(seq.token_ids), drafts)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """The drafts made for `seq` at its current length, at most min(k, room) of them."""
        n = min(self.k, room)
        made = self._drafts.pop(seq.seq_id, None)
        if n <= 0 or made is None or made[0] != len(seq.token_ids):
            return []
        return made[1][:n]

    def forget(self, seq: Sequence) -> None:
        self._drafts.pop(seq.seq_id, None)
