"""TTFT of `vllm bench serve --dataset-name random-mm`'s request shape (one 512 x 512 image plus
~1024 text tokens) at GLM-5.3-Flash's width, on one GPU (issue 62).

The model is the released GLM-5.3-Flash architecture cut to its first --num-hidden-layers layers
(full width, dummy weights, as bench_kimi_linear.py cuts it) with a vision tower: transformers
5.23.0's default `Glm5NextVisionConfig` (depth 24, width 1024) whose merger projects to the text
model's width (the released config.json with the real tower is not on this machine). Each request
is new (a fresh image and fresh text: no prefix-cache or encoder-cache hit), timed from add_request
to its first token, alone on the engine; the same requests without the image (its placeholder
tokens replaced by as many text tokens, so the prefill has the same length) show the tower's share.

    PYTHONPATH=$PWD python3 benchmarks/bench_image_ttft.py [--num-hidden-layers 8] [--quantization fp8] [--text-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_kimi_linear import truncated_checkpoint  # noqa: E402
from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.models.glm5_next_vision import Glm5NextVisionConfig  # noqa: E402

MODEL = "zai-org/GLM-5.3-Flash"


def with_tower(directory: str) -> int:
    """Adds transformers' default vision tower (merger to the text width) to the cut config;
    returns the image token id."""
    path = Path(directory) / "config.json"
    d = json.loads(path.read_text())
    d["vision_config"] = {**Glm5NextVisionConfig().to_dict(), "out_hidden_size": d["hidden_size"]}
    path.write_text(json.dumps(d))
    from kdaserve.models.glm5_next_config import Glm5NextConfig

    return Glm5NextConfig.from_dict(d).image_token_id


def timed(llm: LLM, prompt) -> float:
    eng = llm.engine
    torch.cuda.synchronize()
    s = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    assert not eng.has_unfinished_requests()
    return (time.perf_counter() - s) * 1e3


def main() -> None:
    from PIL import Image

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-hidden-layers", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=1024)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    model = truncated_checkpoint(MODEL, args.num_hidden_layers)
    image_token = with_tower(model)
    t0 = time.time()
    llm = LLM(model, load_format="dummy", max_num_seqs=8, max_model_len=args.text_tokens + 4096,
              max_num_batched_tokens=8192, quantization=args.quantization, warmup=False)
    tower = sum(p.numel() for p in llm.engine.runner.model.visual.parameters())
    print(f"{torch.cuda.get_device_name()}: GLM-5.3-Flash's first {args.num_hidden_layers} layers + tower "
          f"({tower / 1e6:.0f} M parameters), built in {time.time() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(0)
    vocab = 150000   # ordinary text ids, below the special tokens

    def text(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    def image_request() -> dict:
        ids = text(args.text_tokens)
        picture = Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
        return {"prompt_token_ids": ids[:8] + [image_token] + ids[8:], "multi_modal_data": {"image": picture}}

    first = llm.generate([image_request()], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    image_tokens = first.num_prompt_tokens - args.text_tokens
    timed(llm, text(args.text_tokens + image_tokens))   # the text-only shapes compiled too
    with_image, without = [], []
    for _ in range(args.runs):   # alternating, fresh requests each
        with_image.append(timed(llm, image_request()))
        without.append(timed(llm, text(args.text_tokens + image_tokens)))
    print(f"\na request: {args.text_tokens} text tokens + one {args.size} x {args.size} image ({image_tokens} image "
          f"tokens); {args.runs} runs each, alternating; the image's processing (Pillow, CPU) inside the time")
    print("| request | TTFT median ms | min | max |")
    print("|---|---|---|---|")
    for name, t in (("with the image", with_image), ("text only, same length", without)):
        print(f"| {name} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} |")


if __name__ == "__main__":
    main()
