"""The readback ring (kdaserve/engine/readback.py) on the CPU with a fake DMA whose copies land only
when an event is waited on, as a non-blocking device->host copy lands after the host moved on:
every step's tokens read back as sampled, however late they are read, and no buffer or event is
made per step."""

import pytest
import torch

from kdaserve.engine.readback import ReadbackRing
from kdaserve.engine.sampler import PendingSample
from kdaserve.testing.late_dma import LateDMA


def _ring(dma: LateDMA, n: int, nbytes: int = 16) -> ReadbackRing:
    return ReadbackRing(torch.device("cpu"), n, nbytes, event_factory=dma.event, copy_fn=dma.copy)


@pytest.mark.parametrize("num_buffers", [1, 2, 4])
def test_tokens_read_late_or_never_are_the_sampled_ones(num_buffers):
    """Seven steps, read in reverse order after all were started (the worst an engine could do):
    each reads its own tokens, because a buffer coming round makes its unread reader read first."""
    dma = LateDMA()
    ring = _ring(dma, num_buffers)
    steps = [torch.arange(5) * 10 + s for s in range(7)]
    pending = [PendingSample(t.clone(), ring) for t in steps]
    assert [p.token_ids for p in reversed(pending)] == [t.tolist() for t in reversed(steps)]
    assert dma.waits == 7   # each step waited once: on its own read, or when its buffer came round


def test_a_step_read_in_time_never_waits_at_reuse():
    """The engine's order: each step read before the one after next starts. Waits happen only
    inside the reads, never when a buffer comes round."""
    dma = LateDMA()
    ring = _ring(dma, 4)
    pending, got = [], []
    for s in range(10):
        pending.append(PendingSample(torch.full((3,), s), ring))
        if s >= 1:   # async scheduling: step s-1 is read while step s is queued
            got.append(pending[s - 1].token_ids)
    got.append(pending[-1].token_ids)
    assert got == [[s] * 3 for s in range(10)] and dma.waits == 10


def test_log_probs_travel_with_the_tokens_and_buffers_grow_once():
    dma = LateDMA()
    ring = _ring(dma, 2, nbytes=8)
    before = [id(h) for h in ring._host]
    tokens = torch.tensor([3, 1, 4])
    chosen, top_v, top_i = torch.tensor([-0.5, -1.25]), torch.tensor([[-0.5], [-0.25]]), torch.tensor([[3], [7]])
    p = PendingSample(tokens, ring, [chosen, top_v, top_i], lp_rows=[0, 2], num_top=[1, 1])
    assert p.token_ids == [3, 1, 4]
    assert p.logprobs == [(-0.5, [(3, -0.5)]), None, (-1.25, [(7, -0.25)])]
    grown = [id(h) for h in ring._host]
    assert grown[0] != before[0] and grown[1] == before[1]   # only the buffer that was too small
    q = PendingSample(torch.tensor([9]), ring)
    r = PendingSample(torch.tensor([8, 8]), ring)   # back to buffer 0: grown already, reused
    assert (q.token_ids, r.token_ids) == ([9], [8, 8]) and [id(h) for h in ring._host] == grown


def test_the_sampler_reuses_its_ring():
    from kdaserve.engine import SamplingParams
    from kdaserve.engine.detokenizer import IncrementalDetokenizer
    from kdaserve.engine.sampler import Sampler
    from kdaserve.engine.sequence import Sequence
    from kdaserve.models.tokenizer import ByteTokenizer

    sampler = Sampler(torch.device("cpu"), seed=0)
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=4), IncrementalDetokenizer(ByteTokenizer(), []))
            for i in range(3)]
    hosts = {id(sampler.readback._host[i]) for i in range(len(sampler.readback._host))}
    for step in range(9):
        logits = torch.randn(3, 11)
        assert sampler.sample(logits, seqs).token_ids == logits.argmax(-1).tolist()
    assert {id(sampler.readback._host[i]) for i in range(len(sampler.readback._host))} == hosts


def test_a_ring_without_buffers_says_what_it_needs():
    with pytest.raises(ValueError, match="a readback ring needs at least one buffer; got 0"):
        ReadbackRing(torch.device("cpu"), 0)
