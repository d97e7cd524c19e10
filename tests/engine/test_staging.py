"""The pinned staging ring and packed layout (kdaserve/engine/staging.py), on the CPU with a fake
DMA: a copy that reads its source only when its event is waited on, as a non-blocking copy from
pinned memory may read it long after the host moved on."""

import numpy as np
import pytest
import torch

from kdaserve.engine.staging import ALIGN, PackedLayout, StagingRing
from kdaserve.testing.late_dma import LateDMA


def _ring(dma: LateDMA, n: int = 2, nbytes: int = 16) -> StagingRing:
    return StagingRing(nbytes, torch.device("cpu"), n, event_factory=dma.event, copy_fn=dma.copy)


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_a_buffer_is_never_rewritten_while_its_copy_is_pending(num_buffers):
    dma = LateDMA()
    ring = _ring(dma, num_buffers)
    dsts = []
    for step in range(7):
        i, host = ring.acquire(16)
        host[:16] = step + 1                 # this step's data, written into the handed-out buffer
        dst = torch.zeros(16, dtype=torch.uint8)
        ring.submit(i, dst, 16)
        dsts.append(dst)
    dma.flush()
    assert [int(d[0]) for d in dsts] == list(range(1, 8))
    assert all(bool((d == d[0]).all()) for d in dsts)
    assert dma.waits == 7 - num_buffers     # only reuses wait, each exactly once


def test_no_wait_when_the_copy_has_already_run():
    dma = LateDMA()
    ring = _ring(dma, 2)
    for step in range(6):
        i, host = ring.acquire(16)
        ring.submit(i, torch.zeros(16, dtype=torch.uint8), 16)
        dma.flush()          # a stream that keeps up (the engine syncs on its sampled tokens)
    assert dma.waits == 0


def test_growing_a_buffer_waits_for_its_copy_first():
    dma = LateDMA()
    ring = _ring(dma, 1, nbytes=8)
    i, host = ring.acquire(8)
    host[:8] = 5
    first = torch.zeros(8, dtype=torch.uint8)
    ring.submit(i, first, 8)
    i, host = ring.acquire(100)              # replaces the buffer: its copy must have run
    assert dma.waits == 1 and bool((first == 5).all())
    assert ring.capacity(i) >= 100 and host.shape[0] >= 100


def test_plain_memory_on_a_cpu_device_and_no_events():
    ring = StagingRing(32, torch.device("cpu"))
    i, host = ring.acquire(32)
    host[:4] = [1, 2, 3, 4]
    dst = torch.zeros(32, dtype=torch.uint8)
    ring.submit(i, dst, 4)
    assert dst[:4].tolist() == [1, 2, 3, 4] and not ring.pinned


def test_layout_round_trip_aligned_views():
    layout = PackedLayout([("a", torch.int64, (3,)), ("b", torch.int32, (2, 5)), ("c", torch.bool, (4,)),
                           ("d", torch.float32, (0,)), ("e", torch.int32, (1,))])
    names = list(layout.fields)
    assert all(layout.fields[n][0] % ALIGN == 0 for n in names)
    assert all(layout.fields[b][0] >= layout.end_of(a) for a, b in zip(names, names[1:]))   # no overlap
    host = np.zeros(layout.nbytes, dtype=np.uint8)
    hv = layout.host_views(host)
    hv["a"][:] = [-1, 2**40, 7]
    hv["b"][:] = np.arange(10).reshape(2, 5)
    hv["c"][:] = [True, False, True, True]
    hv["e"][:] = 9
    dv = layout.device_views(torch.from_numpy(host.copy()))
    assert dv["a"].dtype == torch.int64 and dv["a"].tolist() == [-1, 2**40, 7]
    assert dv["b"].shape == (2, 5) and dv["b"].flatten().tolist() == list(range(10))
    assert dv["c"].tolist() == [True, False, True, True] and dv["d"].numel() == 0 and dv["e"].tolist() == [9]
    assert layout.end_of("b", 1) == layout.fields["b"][0] + 5 * 4
    with pytest.raises(ValueError, match="dtype"):
        PackedLayout([("x", torch.float64, (1,))])
