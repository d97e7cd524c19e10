"""Host->device staging of a step's small arrays: packed into one pinned host buffer, moved by one
non-blocking copy into one device buffer whose views the step (or a CUDA graph) reads.

Why: a copy from pageable numpy memory is a blocking copy plus a stream sync each; a step used to
make six to ten of them. One copy from pinned memory lets the host go on launching kernels while
the transfer runs.

The hazard of a non-blocking copy is its source: the DMA reads the pinned buffer when the stream
gets to it, possibly after the host has returned and started writing the next step into that same
buffer. Hence a ring of pinned buffers with one CUDA event per buffer, recorded right after the
copy that reads it; a buffer is only handed out again after its event has completed. The host
waits for every step's sampled tokens, and with async scheduling at most one step is queued past
them, so a buffer's copy (two steps back) has run by the time it comes round again and the wait
costs nothing; it matters where the host runs further ahead (prefill chunks that sample no row).
Two buffers let the host fill one while the other's copy is still pending.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np
import torch

# Every array starts on a 256-byte boundary, like a block of torch's CUDA caching allocator: Triton
# specializes kernels on 16-byte pointer alignment, so a packed array must keep what a separate
# allocation would have.
ALIGN = 256

_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedLayout:
    """Byte offsets of named arrays packed into one uint8 buffer (each start ALIGN-aligned)."""

    def __init__(self, fields: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.fields: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        end = 0
        for name, dtype, shape in fields:
            if dtype not in _NP:
                raise ValueError(f"staging field {name!r}: dtype {dtype} is not one of {sorted(map(str, _NP))}")
            offset = _align(end)
            self.fields[name] = (offset, dtype, tuple(shape))
            end = offset + math.prod(shape) * _itemsize(dtype)
        self.nbytes = end

    def end_of(self, name: str, rows: int | None = None) -> int:
        """Byte just past field `name` (past its first `rows` rows when given)."""
        offset, dtype, shape = self.fields[name]
        rows = shape[0] if rows is None else rows
        return offset + rows * math.prod(shape[1:]) * _itemsize(dtype)

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """numpy views of a uint8 host buffer (numpy: a small write costs far less than in torch)."""
        out = {}
        for name, (offset, dtype, shape) in self.fields.items():
            n = math.prod(shape) * _itemsize(dtype)
            out[name] = buf[offset : offset + n].view(_NP[dtype]).reshape(shape)
        return out

    def device_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """torch views of a uint8 device buffer."""
        out = {}
        for name, (offset, dtype, shape) in self.fields.items():
            n = math.prod(shape) * _itemsize(dtype)
            out[name] = buf[offset : offset + n].view(dtype).view(shape)
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return np.dtype(_NP[dtype]).itemsize


class StagingRing:
    """`num_buffers` pinned host buffers (plain ones on a CPU device), reused round-robin.

    Use: `i, host = ring.acquire(nbytes)` (waits until buffer i's last copy has been read, grows it
    if too small), write the step into `host` (a uint8 numpy array), then `ring.submit(i, dst,
    nbytes)`: one non-blocking copy of the first `nbytes` into the uint8 tensor `dst`, and the
    buffer's event recorded behind it on the current stream.

    `event_factory` and `copy_fn` exist for tests (a fake DMA that reads the source late)."""

    def __init__(
        self, nbytes: int, device: torch.device, num_buffers: int = 2, *,
        event_factory: Callable[[], object] | None = None,
        copy_fn: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ):
        if num_buffers < 1:
            raise ValueError(f"a staging ring needs at least one buffer; got {num_buffers}")
        self.pinned = device.type == "cuda"
        if event_factory is None and self.pinned:
            event_factory = torch.cuda.Event
        # A CPU device copies synchronously: nothing is ever pending, no events needed.
        self._events = [event_factory() for _ in range(num_buffers)] if event_factory else None
        self._pending = [False] * num_buffers
        self._copy = copy_fn or _non_blocking_copy
        self._host = [self._alloc(max(nbytes, 1)) for _ in range(num_buffers)]
        self._next = 0

    def _alloc(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return t, t.numpy()

    @property
    def num_buffers(self) -> int:
        return len(self._host)

    def capacity(self, i: int) -> int:
        return self._host[i][0].numel()

    def acquire(self, nbytes: int) -> tuple[int, np.ndarray]:
        i = self._next
        self._next = (i + 1) % len(self._host)
        if self._pending[i]:
            event = self._events[i]
            if not event.query():       # usually done long ago: no blocking call then
                event.synchronize()     # wait until the copy that reads buffer i has run
            self._pending[i] = False
        if self.capacity(i) < nbytes:
            self._host[i] = self._alloc(max(nbytes, 2 * self.capacity(i)))
        return i, self._host[i][1]

    def submit(self, i: int, dst: torch.Tensor, nbytes: int) -> None:
        self._copy(dst[:nbytes], self._host[i][0][:nbytes])
        if self._events is not None:
            # Behind the copy: on the stream of dst's device (not the current device's, if other).
            event = self._events[i]
            event.record(torch.cuda.current_stream(dst.device)) if self.pinned else event.record()
            self._pending[i] = True


def _non_blocking_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def stage_lists(ring: StagingRing, device: torch.device, arrays: dict[str, tuple[torch.dtype, list]]) -> dict[str, torch.Tensor]:
    """Named 1-D host lists -> device tensors through one staging buffer and one copy (into a
    fresh device buffer, so the result outlives the next call)."""
    layout = PackedLayout((name, dtype, (len(values),)) for name, (dtype, values) in arrays.items())
    i, host = ring.acquire(layout.nbytes)
    views = layout.host_views(host)
    for name, (_, values) in arrays.items():
        views[name][:] = values
    dev = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    ring.submit(i, dev, layout.nbytes)
    return layout.device_views(dev)
