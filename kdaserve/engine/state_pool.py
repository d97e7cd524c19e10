"""The state-slot pool: one slot per running request, shared by all KDA layers (each layer's
conv and recurrent caches are `[num_slots, ...]`). Slot 0 is the null slot: never handed out, it
is what CUDA-graph padding rows point at, and kernels skip it."""

from __future__ import annotations

from kdaserve.engine.id_pool import NullFirstIdPool
from kdaserve.engine.sequence import Sequence


class StateSlotPool(NullFirstIdPool):
    def __init__(self, num_slots: int):
        super().__init__(num_slots, "state slot", "the scheduler admits at most max_num_seqs requests")
        self.num_slots = num_slots

    def assign(self, seq: Sequence, num_spec_tokens: int = 0) -> None:
        """Give `seq` its slot, and with speculative decoding its S more (a prefill then leaves the
        state in state_slot: num_accepted = S+1). The caller checked num_free >= S+1."""
        seq.state_slot = self.allocate()
        seq.spec_slots = [self.allocate() for _ in range(num_spec_tokens)]
        seq.num_accepted = num_spec_tokens + 1

    def release(self, seq: Sequence) -> None:
        """Return every slot of `seq` (none held: nothing to do)."""
        for slot in (seq.state_slot, *seq.spec_slots):
            if slot:
                self.free(slot)
        seq.state_slot, seq.spec_slots = 0, []
