"""Device->host transfer of each step's sampled tokens (and log-probs) through a ring of pinned host
buffers, each with its CUDA event, made once: a step allocates no pinned memory and creates no
event (a fresh pinned tensor per step goes through torch's caching host allocator, and a fresh
event is created at its first record and destroyed with the step's result).

A buffer is rewritten only after the step that used it has been read: when a buffer comes round
again and its last reader never asked for its result, the ring makes it read now (waiting for its
copy, keeping the host lists) before the new copy. The engine reads every step's tokens, and with
async scheduling at most two steps are unread at once, so with four buffers that never waits.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class Reader(Protocol):
    def result(self): ...


class ReadbackRing:
    """`num_buffers` host buffers (pinned for a CUDA device) of at least `nbytes`, grown on demand.

    Use: `host, event = ring.start(reader, flat)`: a copy of the 1-D device tensor `flat` into a
    host view (non-blocking from a CUDA device) and the event recorded behind it (None on a CPU);
    `reader` is what will read `host` (its `result()` must wait for `event` and keep what it read).

    `event_factory` and `copy_fn` exist for tests (a fake DMA that writes the destination late)."""

    def __init__(self, device: torch.device, num_buffers: int = 4, nbytes: int = 4 << 10, *,
                 event_factory: Callable[[], object] | None = None,
                 copy_fn: Callable[[torch.Tensor, torch.Tensor], None] | None = None):
        if num_buffers < 1:
            raise ValueError(f"a readback ring needs at least one buffer; got {num_buffers}")
        self.pinned = device.type == "cuda"
        if event_factory is None and self.pinned:
            event_factory = torch.cuda.Event
        self._events = [event_factory() if event_factory else None for _ in range(num_buffers)]
        self._host = [self._alloc(max(nbytes, 8)) for _ in range(num_buffers)]
        self._readers: list[Reader | None] = [None] * num_buffers
        self._copy = copy_fn or (lambda dst, src: dst.copy_(src, non_blocking=self.pinned))
        self._next = 0

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def start(self, reader: Reader, flat: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        i = self._next
        self._next = (i + 1) % len(self._host)
        last = self._readers[i]
        if last is not None:
            last.result()   # a no-op once read; else it reads now, before its buffer is rewritten
        nbytes = flat.numel() * flat.element_size()
        if self._host[i].numel() < nbytes:
            self._host[i] = self._alloc(max(nbytes, 2 * self._host[i].numel()))
        host = self._host[i][:nbytes].view(flat.dtype)
        self._copy(host, flat)
        event = self._events[i]
        if event is not None:
            event.record(torch.cuda.current_stream(flat.device)) if self.pinned else event.record()
        self._readers[i] = reader
        return host, event
