"""GLM-5.3-Flash's vision tower (models/glm5_next_vision.py) against transformers 5.23.0's
`Glm5NextVisionModel` on the CPU: a tiny tower with random weights under the released names, three
images (two sizes) processed together (each attending to itself only), the same image
embeddings in fp32; the tower's names are the checkpoint's (`model.visual.` + these)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kdaserve.models.glm5_next_images import ImageRules, process_image
from kdaserve.models.glm5_next_vision import Glm5NextVisionConfig, Glm5NextVisionTower

TINY = dict(depth=2, hidden_size=64, num_heads=4, out_hidden_size=48, intermediate_size=96,
            projection_intermediate_size=80, swiglu_limit=1.5)


def _hf_tower(seed: int = 0):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig as HFConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    torch.manual_seed(seed)
    config = HFConfig(**TINY)
    config._attn_implementation = "sdpa"
    hf = Glm5NextVisionModel(config).float().eval()
    with torch.no_grad():   # transformers' init leaves norms at one and biases at zero: move every term
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def _images(rules: ImageRules):
    rng = np.random.default_rng(3)
    out = [process_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), rules)
           for h, w in ((90, 130), (60, 60), (60, 60))]   # two of one size: one batched attention call
    return (torch.from_numpy(np.concatenate([o.pixel_values for o in out])), [o.grid_thw for o in out],
            [o.num_tokens for o in out])


def test_the_tower_gives_transformers_image_embeddings():
    hf = _hf_tower()
    ours = Glm5NextVisionTower(Glm5NextVisionConfig.from_dict(hf.config.to_dict()), dtype=torch.float32)
    ours.load_state_dict(hf.state_dict(), strict=True)   # the released names, every one
    pixels, grids, tokens = _images(ImageRules(min_image_tokens=4, max_image_tokens=64))
    with torch.no_grad():
        want = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids)
    assert got.shape == (sum(tokens), 48) == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Each image attends to itself only: the later images alone give their rows of the batch.
    with torch.no_grad():
        alone = ours(pixels[grids[0][1] * grids[0][2]:], grids[1:])
    torch.testing.assert_close(alone, got[tokens[0]:], rtol=1e-5, atol=1e-5)


def test_a_vision_config_kdaserve_does_not_run_is_named():
    with pytest.raises(ValueError, match="silu activation and axial rotary"):
        Glm5NextVisionConfig.from_dict({**TINY, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="multiple of 4"):
        Glm5NextVisionConfig.from_dict({**TINY, "hidden_size": 72, "num_heads": 4})
    tower = Glm5NextVisionTower(Glm5NextVisionConfig.from_dict(TINY))
    with pytest.raises(ValueError, match=r"10 patches for grids \[\(1, 4, 4\)\]"):
        tower(torch.zeros(10, 3 * 2 * 14 * 14), [(1, 4, 4)])


@pytest.mark.gpu
def test_the_tower_in_bf16_on_the_gpu_follows_fp32():
    """The tower as served (bf16 on the GPU, torch SDPA per image) against the same weights in fp32
    on the CPU: two images of different sizes, within bf16's rounding over two blocks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    hf = _hf_tower()
    config = Glm5NextVisionConfig.from_dict(hf.config.to_dict())
    cpu = Glm5NextVisionTower(config, dtype=torch.float32)
    cpu.load_state_dict(hf.state_dict(), strict=True)
    gpu = Glm5NextVisionTower(config, dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict(hf.state_dict(), strict=True)
    pixels, grids, _ = _images(ImageRules(min_image_tokens=4, max_image_tokens=64))
    with torch.no_grad():
        want = cpu(pixels, grids)
        got = gpu(pixels.cuda(), grids).float().cpu()
    assert not got.isnan().any()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-2, err
