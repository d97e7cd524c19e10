"""The encoder cache's plan (engine/encoder_cache.py): which step rows take which image rows, each
image encoded once while resident (chunks, n > 1, re-sent images), the least recently used
dropped past the budget but never one the step uses; and every rank's cache following the plan
gives the same rows as encoding from scratch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdaserve.engine.encoder_cache import EncoderCache, EncoderPlanner
from kdaserve.engine.multimodal import ImageItem, image_hash, place_images


def _item(offset: int, tokens: int, seed: int) -> ImageItem:
    """A random uint8 canvas of 2 x 2t one-pixel patches (_Tower's rules): t tokens."""
    canvas = torch.randint(0, 256, (3, 2, 2 * tokens), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    grid = (1, 2, 2 * tokens)
    return ImageItem(offset, tokens, canvas, grid, image_hash(canvas, grid))


def _seq(images, computed=0, prompt=100):
    return SimpleNamespace(images=tuple(images), num_computed_tokens=computed, num_prompt_tokens=prompt)


def _batch(prefills=(), chunks=(), decodes=()):
    return SimpleNamespace(prefills=list(prefills), num_new_tokens=list(chunks), decodes=list(decodes))


class _Tower:
    """image_pixels: one-pixel patches (each pixel's 3 channels); encode_images: each patch row's
    sum, four patches per token (so rows tell images apart)."""

    def __init__(self):
        self.calls = []

    def image_pixels(self, canvas):
        return canvas.float().reshape(3, -1).T

    def encode_images(self, pixels, grids):
        self.calls.append(len(grids))
        return pixels.sum(-1).view(-1, 4).sum(-1, keepdim=True).expand(-1, 3)


def test_rows_and_sources_of_chunks_decodes_and_several_requests():
    a, b = _item(2, 5, 0), _item(10, 3, 1)
    planner = EncoderPlanner(budget_tokens=100)
    # Request 1 computes prompt tokens [0, 4): a's first two tokens at rows 2, 3 (after one decode row).
    decode = _seq([], computed=50, prompt=10)
    s1 = _seq([a, b])
    plan = planner.plan(_batch([s1], [4], [decode]), 1)
    assert plan.rows == [3, 4] and plan.sources == [(a.mm_hash, 0, 2)] and plan.encode == [a] and plan.drop == []
    # The next chunk [4, 12): a's last three, then b's first two; a is resident, b is encoded.
    s1.num_computed_tokens = 4
    plan = planner.plan(_batch([s1], [8]), 1)
    assert plan.rows == [0, 1, 2, 6, 7]
    assert plan.sources == [(a.mm_hash, 2, 3), (b.mm_hash, 0, 2)] and plan.encode == [b]
    # A second request with the same image (n > 1): nothing to encode.
    s2 = _seq([_item(0, 5, 0)])
    plan = planner.plan(_batch([s2], [5]), 1)
    assert plan.encode == [] and plan.rows == list(range(5))
    # A decode row still in the prompt (a prefix hit left one token): its row too.
    s3 = _seq([b], computed=12, prompt=13)
    assert planner.plan(_batch(decodes=[s3]), 1).rows == [0]
    # No images in the step: no plan.
    assert planner.plan(_batch([_seq([])], [8]), 1) is None


def test_past_the_budget_the_least_recently_used_go_but_never_one_the_step_uses():
    items = [_item(0, 4, i) for i in range(3)]
    planner = EncoderPlanner(budget_tokens=6)
    planner.plan(_batch([_seq([items[0]])], [4]), 1)
    plan = planner.plan(_batch([_seq([items[1]])], [4]), 1)
    assert plan.drop == [items[0].mm_hash]   # 8 tokens > 6: the older one goes
    # A step using two images over the budget keeps both.
    plan = planner.plan(_batch([_seq([items[1]]), _seq([items[2]])], [4, 4]), 1)
    assert plan.drop == [] and list(planner.resident) == [items[1].mm_hash, items[2].mm_hash]


def test_a_cache_following_the_plans_gives_the_rows_of_a_fresh_encoding():
    a, b = _item(1, 5, 0), _item(8, 3, 1)
    tower = _Tower()
    planner, cache = EncoderPlanner(budget_tokens=5), EncoderCache(tower, "cpu", call_tokens=100)
    s = _seq([a, b])
    got = []
    for start, n in ((0, 3), (3, 4), (7, 5)):
        s.num_computed_tokens = start
        rows, embeds = cache.apply(planner.plan(_batch([s], [n]), 1))
        got.append((rows, embeds))
    assert tower.calls == [1, 1]   # a once (kept for its second chunk), b once
    full = torch.cat([tower.encode_images(tower.image_pixels(i.canvas), [i.grid_thw]) for i in (a, b)])
    assert torch.equal(torch.cat([r for r, _ in got]), torch.tensor([1, 2, 0, 1, 2, 1, 2, 3]))
    assert torch.equal(torch.cat([e for _, e in got]), full)
    assert list(planner.resident) == [b.mm_hash]   # a dropped once b came past the budget


def test_a_step_encodes_in_calls_of_at_most_the_planned_tokens():
    """Several images starting in one step: encoded together up to call_tokens a call (the size the
    memory plan profiled), an image over it alone; the rows are those of one call."""
    items = [_item(i * 10, n, i) for i, n in enumerate((3, 4, 9, 2))]
    tower = _Tower()
    plan = EncoderPlanner(budget_tokens=100).plan(_batch([_seq(items)], [40]), 1)
    rows, embeds = EncoderCache(tower, "cpu", call_tokens=7).apply(plan)
    assert tower.calls == [2, 1, 1]   # 3 + 4, then 9 alone, then 2
    alone = torch.cat([_Tower().encode_images(tower.image_pixels(i.canvas), [i.grid_thw]) for i in items])
    assert torch.equal(embeds, alone) and len(rows) == 18


def test_placeholders_expand_in_order_and_an_expanded_prompt_is_kept():
    images = [SimpleNamespace(canvas=torch.zeros(3, 2, 4, dtype=torch.uint8), grid_thw=(1, 2, 4), num_tokens=2),
              SimpleNamespace(canvas=torch.ones(3, 2, 6, dtype=torch.uint8), grid_thw=(1, 2, 6), num_tokens=3)]
    ids, placed = place_images([5, 9, 6, 9, 9, 9, 7], 9, images)
    assert ids == [5, 9, 9, 6, 9, 9, 9, 7]
    assert [(p.offset, p.num_tokens) for p in placed] == [(1, 2), (4, 3)]
    assert placed[0].mm_hash != placed[1].mm_hash


@pytest.mark.parametrize("value, message", [
    ("{", r"invalid limit_mm_per_prompt: not JSON .*; expected an object like \{\"image\": 2\}"),
    ("[1]", r"invalid limit_mm_per_prompt: got list; expected a JSON object"),
    ({"image": -1}, r"invalid limit_mm_per_prompt\['image'\]: got -1; expected an integer >= 0"),
    ({"video": 1}, r"kdaserve takes images only, not video; give \{\"video\": 0\} or leave it out"),
    ({"sound": 1}, r"unknown modality 'sound'; expected \"image\""),
])
def test_limit_mm_per_prompt_refusals_say_what_is_accepted(value, message):
    from kdaserve.engine.config import parse_mm_limits

    with pytest.raises(ValueError, match=message):
        parse_mm_limits(value)
    assert parse_mm_limits('{"image": 2, "video": 0}') == {"image": 2}
    assert parse_mm_limits({"image": {"count": 3}}) == {"image": 3} and parse_mm_limits(None) == {"image": 8}
