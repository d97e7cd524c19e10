"""Image embeddings for a step: which images the vision tower encodes, which it keeps, and which
rows of the step take which embedding rows.

Rank 0 plans (EncoderPlanner, host only): for every row of the step that holds an image
placeholder (prefill chunks, and a decode row still in the prompt), the image and the token of
it; images not resident are encoded in this step, together in calls of at most the size the memory
plan profiled (encoder_call_tokens); residents the
step does not use are dropped, least recently used first, once they hold more than the budget of
tokens. The plan (StepImages) travels with the step to every tensor-parallel rank, and each rank's
EncoderCache follows it, so every rank holds the same embeddings without a collective. An image
is encoded once for all the requests and chunks that use it while it stays resident (n > 1, a
re-sent image, chunked prefill cutting through it); evicted and needed again, it is encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from kdaserve.engine.multimodal import ImageItem


@dataclass
class StepImages:
    """One step's images, as every rank needs them."""

    encode: list[ImageItem] = field(default_factory=list)   # not resident: encoded before the forward
    drop: list[bytes] = field(default_factory=list)          # residents to free (after encoding)
    rows: list[int] = field(default_factory=list)            # step rows that take an image embedding, ascending
    # Where those rows' embeddings come from, in row order: (image hash, first token, tokens).
    sources: list[tuple[bytes, int, int]] = field(default_factory=list)


class EncoderPlanner:
    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self.resident: OrderedDict[bytes, int] = OrderedDict()   # hash -> tokens, least recently used first

    def plan(self, batch, tokens_per_decode: int) -> StepImages | None:
        """The images of `batch` (scheduler.ScheduledBatch) or None when it has none."""
        out = StepImages()
        used: dict[bytes, ImageItem] = {}

        def take(seq, row: int, start: int, n: int) -> None:
            for item in seq.images:
                a, b = max(start, item.offset), min(start + n, item.end)
                if a < b:
                    out.rows.extend(range(row + a - start, row + b - start))
                    out.sources.append((item.mm_hash, a - item.offset, b - a))
                    used.setdefault(item.mm_hash, item)

        if tokens_per_decode == 1:   # a verify's rows are past the prompt
            for i, seq in enumerate(batch.decodes):
                if seq.images and seq.num_computed_tokens < seq.num_prompt_tokens:
                    take(seq, i, seq.num_computed_tokens, 1)
        row = len(batch.decodes) * tokens_per_decode
        for seq, n in zip(batch.prefills, batch.num_new_tokens):
            if seq.images:
                take(seq, row, seq.num_computed_tokens, n)
            row += n
        if not used:
            return None
        for h, item in used.items():
            if h in self.resident:
                self.resident.move_to_end(h)
            else:
                out.encode.append(item)
                self.resident[h] = item.num_tokens
        total = sum(self.resident.values())
        for h in list(self.resident):
            if total <= self.budget:
                break
            if h not in used:
                total -= self.resident.pop(h)
                out.drop.append(h)
        return out


def encoder_call_tokens(config, model) -> int:
    """Image tokens one vision-tower call encodes at most: the step's token budget, or the largest
    image the model's rules allow where that is more (one image is never split). The memory plan
    profiles a call of this size (engine/memory.py), so no step's encoding exceeds what it planned."""
    return max(config.max_num_batched_tokens, model.image_rules.max_image_tokens)


def warm_up_grid(tokens: int, merge: int = 2) -> tuple[int, int, int]:
    """A (1, h, w) patch grid of at most `tokens` merged tokens, near square: the profiled image."""
    side = max(1, int(tokens**0.5))
    return 1, merge * side, merge * max(1, tokens // side)


class EncoderCache:
    """A rank's image embeddings by hash, kept as its StepImages say."""

    def __init__(self, model, device, call_tokens: int):
        self.model, self.device, self.call_tokens = model, device, call_tokens
        self.embeddings: dict[bytes, torch.Tensor] = {}

    def apply(self, images: StepImages) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode (images together, up to call_tokens a call), drop, then (rows [R] int64,
        embeddings [R, hidden]) for the forward."""
        for group in _calls(images.encode, self.call_tokens):
            # The uint8 canvases to the device, the tower's float patches made there.
            pixels = torch.cat([self.model.image_pixels(item.canvas.to(self.device, non_blocking=True))
                                for item in group])
            out = self.model.encode_images(pixels, [item.grid_thw for item in group])
            for item, emb in zip(group, out.split([item.num_tokens for item in group])):
                self.embeddings[item.mm_hash] = emb
        for h in images.drop:
            self.embeddings.pop(h, None)
        embeds = torch.cat([self.embeddings[h][a : a + n] for h, a, n in images.sources])
        rows = torch.from_numpy(np.asarray(images.rows, dtype=np.int64)).to(self.device, non_blocking=True)
        return rows, embeds


def _calls(items: list[ImageItem], limit: int) -> list[list[ImageItem]]:
    """Consecutive groups of at most `limit` tokens (an image over it alone)."""
    groups: list[list[ImageItem]] = []
    total = 0
    for item in items:
        if not groups or total + item.num_tokens > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += item.num_tokens
    return groups
