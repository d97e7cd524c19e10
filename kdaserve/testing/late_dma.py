"""A fake DMA engine for tests of host<->device transfer rings on the CPU: copies queue up and
land only when an event recorded after them is waited on (or on flush), reading their source and
writing their destination at that moment, as a non-blocking copy from or to pinned memory may
run long after the host moved on."""

from __future__ import annotations

import torch


class LateDMA:
    """Copies queue up; an event's synchronize() (or flush) runs every copy queued before it,
    reading the source buffer at that moment."""

    def __init__(self):
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0        # copies run so far
        self.waits = 0

    def copy(self, dst, src):
        self.queue.append((dst, src))

    def run_until(self, count: int) -> None:
        while self.done < count:
            dst, src = self.queue.pop(0)
            dst.copy_(src)
            self.done += 1

    def flush(self) -> None:
        self.run_until(self.done + len(self.queue))

    def event(self):
        dma = self

        class Event:
            mark = 0

            def record(self):
                self.mark = dma.done + len(dma.queue)

            def query(self):
                return dma.done >= self.mark

            def synchronize(self):
                dma.waits += 1
                dma.run_until(self.mark)

        return Event()
