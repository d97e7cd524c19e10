"""GLM-5.3-Flash's image processing (the rules of transformers' `Glm5NextImageProcessorPil`, written
for kdaserve with Pillow and numpy): an image becomes `pixel_values` [patches, 3 x 2 x 14 x 14]
and its grid (1, h, w) of 14-pixel patches, and its placeholder in the prompt becomes h w / 4
image tokens (the vision tower merges 2 x 2 patches into one token).

Two halves: `process_image` (the API process: decode, resize, pad) gives the padded canvas in
uint8, what travels to the engine (a 512 x 512 image: 0.85 MB, against 6.8 MB of float32 patches
with their repeated frame); `canvas_pixels` (the engine, on the tower's device) rescales,
normalizes and patchifies it, the same values bit for bit as transformers' processor.

- Size: the image is fitted onto a canvas whose sides are multiples of 28 (patch 14 x merge 2)
  holding between `min_image_tokens` and `max_image_tokens` tokens (16 and 8000 as released):
  scaled down (never up, unless it is below the minimum) to fit, resized with bicubic
  resampling, then padded with zeros at the bottom and right to the canvas (`canvas_size`).
- Values: RGB (transparency composited onto white), rescaled by 1/255, normalized by CLIP's mean and std (the padding too).
- Patches: row-major over 2 x 2 merge blocks, each patch's pixels channel-major, repeated for
  the tower's 2 temporal frames (a still image is its own second frame).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Pillow (the serve / test extras) is imported where an image is converted or resized: the rules and
# token counts below need no Pillow, so a vision model loads (and serves text) without it.

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageRules:
    """The processor's settings (preprocessor_config.json's names)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_dict(cls, d: dict) -> ImageRules:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("image_mean", "image_std"):
            if k in known:
                known[k] = tuple(known[k])
        return cls(**known)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def image_rules(model_dir) -> ImageRules:
    """A checkpoint directory's rules (its preprocessor_config.json), else the released defaults."""
    import json
    from pathlib import Path

    path = Path(str(model_dir)) / "preprocessor_config.json"
    if not path.is_file():
        return ImageRules()
    return ImageRules.from_dict(json.loads(path.read_text()))


def canvas_size(height: int, width: int, rules: ImageRules = ImageRules()) -> tuple[int, int]:
    """The padded canvas (height, width) an image of this size is placed on: multiples of
    `rules.factor` within the token budget (transformers' `smart_resize` for one still image)."""
    factor, frames = rules.factor, rules.temporal_patch_size
    per_token = frames * factor**2
    min_pixels, max_pixels = rules.min_image_tokens * per_token, rules.max_image_tokens * per_token

    def align(value: int) -> int:
        return math.ceil(value / factor) * factor

    h, w = align(height), align(width)
    if frames * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (frames * height * width))
        h, w = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if frames * h * w > max_pixels:
        if max_pixels < frames * factor**2:
            raise ValueError(f"max_image_tokens={rules.max_image_tokens} leaves no room for one {factor}-pixel patch")
        low, high, h, w = 1, height, factor, factor   # the tallest content height whose canvas fits
        while low <= high:
            mid = (low + high) // 2
            ch, cw = align(mid), align(max(1, math.floor(width * mid / height)))
            if frames * ch * cw <= max_pixels:
                h, w, low = ch, cw, mid + 1
            else:
                high = mid - 1
    return h, w


def content_size(height: int, width: int, canvas: tuple[int, int], rules: ImageRules = ImageRules()) -> tuple[int, int]:
    """The size the image is resized to before padding onto `canvas`: scaled to fit it, never up
    unless the image is below the token minimum."""
    ch, cw = canvas
    scale = min(ch / height, cw / width)
    if rules.temporal_patch_size * height * width >= rules.temporal_patch_size * rules.factor**2 * rules.min_image_tokens:
        scale = min(1.0, scale)
    return max(1, min(ch, math.floor(height * scale))), max(1, min(cw, math.floor(width * scale)))


def num_image_tokens(height: int, width: int, rules: ImageRules = ImageRules()) -> int:
    """Placeholder tokens an image of this size takes in the prompt."""
    h, w = canvas_size(height, width, rules)
    return (h // rules.patch_size) * (w // rules.patch_size) // rules.merge_size**2


@dataclass(frozen=True)
class ProcessedImage:
    canvas: np.ndarray            # uint8 [3, height, width]: resized and padded, before rescaling
    grid_thw: tuple[int, int, int]
    num_tokens: int               # its placeholder tokens in the prompt: patches / merge_size^2
    rules: ImageRules = ImageRules()

    @property
    def pixel_values(self) -> np.ndarray:
        """float32 [patches, 3 * temporal * patch * patch]: the tower's input (canvas_pixels on the host)."""
        import torch

        return canvas_pixels(torch.from_numpy(self.canvas), self.rules).numpy()


def to_rgb(image):
    """RGB, transparency composited onto white (a transparent PNG's empty parts read as white)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        from PIL import Image

        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def process_image(image, rules: ImageRules = ImageRules()) -> ProcessedImage:
    """One decoded image -> its patches and grid, by the rules above."""
    rgb = to_rgb(image)
    width, height = rgb.size
    canvas = canvas_size(height, width, rules)
    ch, cw = content_size(height, width, canvas, rules)
    if (ch, cw) != (height, width):
        from PIL import Image

        rgb = rgb.resize((cw, ch), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)                       # [3, h, w]
    pixels = np.ascontiguousarray(np.pad(pixels, ((0, 0), (0, canvas[0] - ch), (0, canvas[1] - cw)), mode="constant"))
    grid = canvas_grid(pixels.shape, rules)
    return ProcessedImage(pixels, grid, grid[1] * grid[2] // rules.merge_size**2, rules)


def canvas_grid(shape, rules: ImageRules = ImageRules()) -> tuple[int, int, int]:
    """A [3, height, width] canvas's patch grid (1, height / patch, width / patch)."""
    return 1, shape[-2] // rules.patch_size, shape[-1] // rules.patch_size


def canvas_pixels(canvas, rules: ImageRules = ImageRules()):
    """uint8 canvas [3, height, width] (a torch tensor, on any device) -> the tower's float32 patches
    [patches, 3 * temporal * patch * patch]: rescaled by 1/255 in float64 and rounded once, then
    normalized in float32, as transformers' processor computes them (bit for bit: IEEE operations
    in the same order); patches row-major over 2 x 2 merge blocks, channel-major inside, the
    still image repeated for the temporal frames."""
    import torch

    values = (canvas.to(torch.float64) * (1 / 255)).to(torch.float32)
    mean = torch.tensor(rules.image_mean, dtype=torch.float32, device=canvas.device)[:, None, None]
    std = torch.tensor(rules.image_std, dtype=torch.float32, device=canvas.device)[:, None, None]
    values = (values - mean) / std
    p, m, t = rules.patch_size, rules.merge_size, rules.temporal_patch_size
    c, height, width = values.shape
    gh, gw = height // p, width // p
    patches = values.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches[:, :, :, :, :, None].expand(*patches.shape[:5], t, p, p)
    return patches.reshape(gh * gw, c * t * p * p)
