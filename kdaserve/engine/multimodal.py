"""Images in a request, in the one form the engine carries them from the API to the model.

A prompt holds one image placeholder token per image (the chat template writes it between the
image's begin / end tokens); the engine expands each into the image's own number of placeholder
tokens (vLLM's prompt replacement), and the model's embedding of those tokens is replaced by the
vision tower's output, one row per token (engine/encoder_cache.py). An image travels as its
processed uint8 canvas (resized and padded; models/glm5_next_images.py), which the encoder turns
into the tower's float patches on its device. Each image is identified by a hash of that canvas
(vLLM's `mm_hash`): the encoder cache shares one encoding among the
requests that send the same image (n > 1 included), and prefix-cache keys include the hashes of
the images a block covers, so equal text around different images never shares a cache hit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt, processed (models/glm5_next_images.process_image) and placed."""

    offset: int                       # its first placeholder token's index in the prompt
    num_tokens: int                   # its placeholder tokens: one embedding row each
    canvas: torch.Tensor              # uint8 [channels, height, width], resized and padded, on the host
    grid_thw: tuple[int, int, int]    # (frames, patch rows, patch columns)
    mm_hash: bytes                    # of the canvas and grid: equal images, equal hashes

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_hash(canvas: np.ndarray | torch.Tensor, grid_thw: tuple[int, int, int]) -> bytes:
    """SHA-256 of the processed canvas and its grid (what the encoder's output depends on)."""
    values = canvas.numpy() if isinstance(canvas, torch.Tensor) else canvas
    h = hashlib.sha256(repr((tuple(grid_thw), values.shape)).encode())
    h.update(np.ascontiguousarray(values, dtype=np.uint8).tobytes())
    return h.digest()


def place_images(prompt_ids: list[int], image_token_id: int, images) -> tuple[list[int], tuple[ImageItem, ...]]:
    """The prompt with each image's placeholder expanded to its tokens, and the images placed.

    `images`: processed images (each with `canvas`, `grid_thw`, `num_tokens`), in prompt
    order. A run of placeholder tokens is one image's: a single token is expanded, a run of exactly
    the image's tokens (a prompt expanded already) is kept; anything else is a ValueError saying
    what was found and what is needed."""
    runs = _placeholder_runs(prompt_ids, image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt holds {len(runs)} image placeholder(s) (token {image_token_id}) for {len(images)} "
                         f"image(s); expected one placeholder per image, in order")
    out: list[int] = []
    items = []
    prev = 0
    for (start, length), image in zip(runs, images):
        if length not in (1, image.num_tokens):
            raise ValueError(f"an image placeholder run of {length} tokens at prompt index {start}: expected 1 (expanded "
                             f"here) or the image's {image.num_tokens}")
        out.extend(prompt_ids[prev:start])
        if isinstance(image, ImageItem):   # placed before (a server's API process): its hash kept
            items.append(ImageItem(len(out), image.num_tokens, image.canvas, image.grid_thw, image.mm_hash))
        else:
            canvas = image.canvas
            canvas = torch.from_numpy(np.ascontiguousarray(canvas, dtype=np.uint8)) if isinstance(canvas, np.ndarray) \
                else canvas.to(torch.uint8).contiguous()
            items.append(ImageItem(len(out), image.num_tokens, canvas, tuple(image.grid_thw),
                                   image_hash(canvas, image.grid_thw)))
        out.extend([image_token_id] * image.num_tokens)
        prev = start + length
    out.extend(prompt_ids[prev:])
    return out, tuple(items)


def _placeholder_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def block_image_keys(items: tuple[ImageItem, ...], start: int, end: int) -> tuple[bytes, ...]:
    """The hashes of the images with tokens in prompt positions [start, end) (a cache block's
    extra key: vLLM's mm_hash in its block hashes)."""
    return tuple(item.mm_hash for item in items if item.offset < end and item.end > start)
