"""GLM-5.3-Flash's image processing (models/glm5_next_images.py) against transformers 5.23.0's
`Glm5NextImageProcessorPil` on the CPU: the same pixel values bit for bit and the same grid for
random images of every shape class (square, extreme aspect, below the token minimum, above the
maximum, grayscale, with alpha), and the same placeholder count the processor expands to."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kdaserve.models.glm5_next_images import ImageRules, canvas_size, num_image_tokens, process_image

pytest.importorskip("transformers.models.glm5_next.image_processing_pil_glm5_next")


def _hf(**kw):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    return Glm5NextImageProcessorPil(**kw)


@pytest.mark.parametrize("size, mode", [((512, 512), "RGB"), ((37, 901), "RGB"), ((3000, 40), "RGB"), ((10, 10), "RGB"),
                                        ((1080, 1920), "RGB"), ((4000, 3000), "RGB"), ((333, 257), "L"),
                                        ((200, 120), "RGBA")])
def test_pixels_and_grid_equal_transformers(size, mode):
    h, w = size
    rng = np.random.default_rng(h * w)
    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    array = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    image = Image.fromarray(array[..., 0] if channels == 1 else array, mode)
    want = _hf()(images=[image], return_tensors="np")
    ours = process_image(image)
    assert ours.grid_thw == tuple(int(v) for v in want["image_grid_thw"][0])
    assert ours.pixel_values.dtype == np.float32 and np.array_equal(ours.pixel_values, want["pixel_values"])
    assert ours.num_tokens == num_image_tokens(h, w) == int(np.prod(want["image_grid_thw"][0])) // 4


def test_the_token_budget_is_read_from_the_processors_settings():
    """A preprocessor_config.json's min / max image tokens change the canvas as transformers' do."""
    rules = ImageRules.from_dict({"min_image_tokens": 4, "max_image_tokens": 64, "patch_size": 14, "merge_size": 2,
                                  "image_processor_type": "Glm5NextImageProcessor"})
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (700, 500, 3), dtype=np.uint8))
    want = _hf(min_image_tokens=4, max_image_tokens=64)(images=[image], return_tensors="np")
    ours = process_image(image, rules)
    assert ours.grid_thw == tuple(int(v) for v in want["image_grid_thw"][0]) and ours.num_tokens <= 64
    assert np.array_equal(ours.pixel_values, want["pixel_values"])
    with pytest.raises(ValueError, match="max_image_tokens=0 leaves no room"):
        canvas_size(700, 500, ImageRules(max_image_tokens=0))


def test_the_canvas_travels_in_uint8_and_becomes_the_same_patches_on_any_device():
    """What crosses to the engine is the uint8 canvas (an eighth of the float32 patches with their
    repeated frame); the patches made from it on the tower's device are the processor's bit for bit
    (on a GPU too: IEEE operations in the same order)."""
    import torch

    from kdaserve.models.glm5_next_images import canvas_pixels

    image = Image.fromarray(np.random.default_rng(7).integers(0, 256, (300, 410, 3), dtype=np.uint8))
    ours = process_image(image)
    want = _hf()(images=[image], return_tensors="np")["pixel_values"]
    assert ours.canvas.dtype == np.uint8 and ours.canvas.nbytes * 8 == want.nbytes
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        got = canvas_pixels(torch.from_numpy(ours.canvas).to(device)).cpu().numpy()
        assert got.dtype == np.float32 and np.array_equal(got, want), device
