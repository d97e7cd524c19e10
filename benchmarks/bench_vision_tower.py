"""GLM-5.3-Flash's vision tower on one GPU (issue 62): the time of one 512 x 512 image (the request
shape of `vllm bench serve --dataset-name random-mm`) and of a batch of them through the tower,
random weights in bf16, with the image processing on the CPU beside it.

The tower's config is transformers 5.23.0's default `Glm5NextVisionConfig` (depth 24, width 1024,
16 heads, merger to 1536) unless --out-hidden-size names the text model's width (no released
config.json on this machine to confirm the real one against).

    PYTHONPATH=$PWD python3 benchmarks/bench_vision_tower.py [--batches 1 8 32] [--size 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdaserve.models.glm5_next_images import ImageRules, process_image  # noqa: E402
from kdaserve.models.glm5_next_vision import Glm5NextVisionConfig, Glm5NextVisionTower  # noqa: E402


def main() -> None:
    from PIL import Image

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--out-hidden-size", type=int, default=None)
    args = ap.parse_args()
    config = Glm5NextVisionConfig(**({"out_hidden_size": args.out_hidden_size} if args.out_hidden_size else {}))
    tower = Glm5NextVisionTower(config, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * p[0].numel() ** -0.5)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    t0 = time.perf_counter()
    for _ in range(10):
        done = process_image(image, ImageRules())
    process_ms = (time.perf_counter() - t0) / 10 * 1e3
    params = sum(p.numel() for p in tower.parameters())
    rows = []
    for b in args.batches:
        pixels = torch.from_numpy(np.concatenate([done.pixel_values] * b)).cuda()
        grids = [done.grid_thw] * b
        with torch.no_grad():
            out = tower(pixels, grids)
            assert out.shape == (b * done.num_tokens, config.out_hidden_size) and not out.isnan().any()
            ms = triton.testing.do_bench(lambda: tower(pixels, grids), warmup=3, rep=30)
        rows.append((b, ms))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}; tower {params / 1e6:.0f} M parameters (bf16); a {args.size} x "
          f"{args.size} image: grid {done.grid_thw}, {done.num_tokens} tokens; processing on the CPU "
          f"{process_ms:.1f} ms per image")
    print("| images | ms (do_bench median) | ms per image | image tokens / s |")
    print("|---|---|---|---|")
    for b, ms in rows:
        print(f"| {b} | {ms:.2f} | {ms / b:.2f} | {b * done.num_tokens / ms * 1e3:.0f} |")


if __name__ == "__main__":
    main()
