"""The state-slot pool: one slot per running request, shared by all KDA layers (each layer's
conv and recurrent caches are `[num_slots, ...]`). Slot 0 is the null slot: never handed out, it
is what CUDA-graph padding rows point at, and kernels skip it."""

from __future__ import annotations

from kdaserve.engine.id_pool import NullFirstIdPool


class StateSlotPool(NullFirstIdPool):
    def __init__(self, num_slots: int):
        super().__init__(num_slots, "state slot", "the scheduler admits at most max_num_seqs requests")
        self.num_slots = num_slots
