"""GLM-5.3-Flash with images through the engine, against transformers 5.23.0's
`Glm5NextForConditionalGeneration` (fp32, CPU): a tiny checkpoint with a vision tower written with
the released names (`model.visual.*`), the image placeholder expanded as the processor expands it,
the tower's embeddings merged at the placeholders.

Prompt log-probs of every position with one image and with two of different sizes within relative
RMS 1e-4; greedy tokens equal alone, batched with a text-only request, with chunked prefill cutting
through an image, and with a prefix-cache hit on the text before the image; the same text with two
different images gives different log-probs and no cache hit past the image."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
Image = pytest.importorskip("PIL.Image")

from family_parity import dense_row
from safetensors.torch import save_file
from test_glm5_next import REF, VOCAB, tiny_config

from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.glm5_next import random_released_tensors
from kdaserve.models.glm5_next_images import ImageRules, process_image
from kdaserve.models.glm5_next_vision import Glm5NextVisionConfig, Glm5NextVisionTower
from kdaserve.testing.compare import rel_rms

IMAGE, BEGIN, END = 259, 257, 258   # the image placeholder and its brackets (ids inside the tiny vocabulary)
VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
          "projection_intermediate_size": 48, "patch_size": 14, "swiglu_limit": 1.5}
RULES = {"min_image_tokens": 4, "max_image_tokens": 24}   # small images: 4 to 24 tokens each


def _vision_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tower = Glm5NextVisionTower(Glm5NextVisionConfig.from_dict(VISION), dtype=torch.float32)
    out = {}
    for name, t in tower.state_dict().items():
        # Norm weights near one, everything else small and random (transformers' init would leave
        # biases at zero and norms at one: every term moves here).
        base = 1.0 if t.dim() == 1 and "norm" in name and "bias" not in name else 0.0
        out["model.visual." + name] = base + torch.randn(t.shape, generator=g) * (0.2 if t.dim() == 1 else t.shape[-1] ** -0.5)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm-vision") / "ckpt"
    path.mkdir()
    config = tiny_config(index_topk=64)
    text = {**config.to_dict(), "model_type": "glm5_next_text"}
    released = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"], "text_config": text,
                "vision_config": VISION, "image_token_id": IMAGE, "image_start_token_id": BEGIN,
                "image_end_token_id": END, "video_token_id": 255, "video_start_token_id": 253,
                "video_end_token_id": 254, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(released))
    (path / "preprocessor_config.json").write_text(json.dumps(RULES))
    tensors = {k: v.contiguous() for k, v in random_released_tensors(config, 3, dtype=torch.float32)}
    tensors.update(_vision_tensors(5))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _copy_with_vision(src, dst, vision: dict[str, torch.Tensor], config_extra: dict | None = None):
    """`src`'s checkpoint with other vision tensors (and config keys)."""
    from safetensors.torch import load_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **(config_extra or {})}))
    (dst / "preprocessor_config.json").write_text((src / "preprocessor_config.json").read_text())
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("model.visual.")}
    save_file({**tensors, **vision}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def _image(h: int, w: int, seed: int):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(text_before: list[int], n_images: int, text_after: list[int]) -> list[int]:
    return text_before + [BEGIN, IMAGE, END] * n_images + text_after


def _expanded(prompt: list[int], images) -> tuple[list[int], torch.Tensor, list]:
    """transformers' inputs: the placeholder expanded, the images' patches and grids."""
    done = [process_image(im, ImageRules(**RULES)) for im in images]
    ids, k = [], 0
    for t in prompt:
        if t == IMAGE:
            ids.extend([IMAGE] * done[k].num_tokens)
            k += 1
        else:
            ids.append(t)
    return ids, torch.from_numpy(np.concatenate([d.pixel_values for d in done])), [d.grid_thw for d in done]


def _hf_logprobs(hf, prompt, images) -> torch.Tensor:
    ids, pixels, grids = _expanded(prompt, images)
    with torch.no_grad():
        return hf(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=torch.tensor(grids)).logits[0].log_softmax(-1)


def _hf_greedy(hf, prompt, images, n: int = 16) -> list[int]:
    ids, pixels, grids = _expanded(prompt, images)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=torch.tensor(grids),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _ours_logprobs(llm, prompt, images) -> tuple[torch.Tensor, list[int]]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=VOCAB, logprobs=VOCAB, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, params, use_tqdm=False)[0]
    rows = [dense_row(e, VOCAB) for e in out.prompt_logprobs[1:]] + [dense_row(out.logprobs[0], VOCAB)]
    return torch.stack(rows), out.prompt_token_ids


ONE = (_prompt([72, 105, 32], 1, [100, 101, 115, 99]), [(70, 100, 1)])
TWO = (_prompt([87, 104, 97, 116], 2, [63, 10]), [(90, 130, 2), (40, 40, 3)])


@pytest.mark.parametrize("case", [ONE, TWO], ids=["one-image", "two-images"])
def test_prompt_log_probs_with_images_match_transformers(ckpt, hf, case):
    prompt, sizes = case
    images = [_image(*s) for s in sizes]
    llm = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, **REF)
    ours, expanded = _ours_logprobs(llm, prompt, images)
    assert expanded == _expanded(prompt, images)[0]   # usage counts the expanded prompt
    ref = _hf_logprobs(hf, prompt, images)
    assert not ours.isnan().any()
    assert rel_rms(ours, ref) <= 1e-4, rel_rms(ours, ref)
    # The images matter: a prompt with the placeholders but other images scores otherwise.
    other = [_image(*s[:2], s[2] + 10) for s in sizes]
    assert rel_rms(_hf_logprobs(hf, prompt, other), ref) > 1e-3


def test_greedy_tokens_with_images_alone_batched_chunked_and_after_a_prefix_hit(ckpt, hf):
    prompt, sizes = TWO
    images = [_image(*s) for s in sizes]
    want = _hf_greedy(hf, prompt, images)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    request = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
    text_only = list(range(40, 70))

    llm = LLM(str(ckpt), max_model_len=256, **REF)
    assert llm.generate(request, greedy, use_tqdm=False)[0].output_token_ids == want              # alone
    outs = llm.generate([text_only, request, text_only[:9]], greedy, use_tqdm=False)             # batched
    assert outs[1].output_token_ids == want
    alone_text = llm.generate([text_only], greedy, use_tqdm=False)[0].output_token_ids
    assert outs[0].output_token_ids == alone_text
    # Prefill chunks of 5 tokens: the first image's tokens (and the second's) cut across steps.
    chunked = LLM(str(ckpt), max_model_len=256, max_num_batched_tokens=5, **REF)
    assert chunked.generate(request, greedy, use_tqdm=False)[0].output_token_ids == want
    # A cached prefix ending before the images (32 text tokens, checkpoints every 16), then the images.
    long_text = list(range(100, 132))
    cached = LLM(str(ckpt), max_model_len=256, block_size=16, mamba_block_size=16, **REF)
    cached.generate([long_text + [7, 8]], greedy, use_tqdm=False)
    with_images = {"prompt_token_ids": long_text + prompt, "multi_modal_data": {"image": images}}
    hits = cached.engine.stats()["prefix_cache_hits"]
    got = cached.generate(with_images, greedy, use_tqdm=False)[0]
    assert cached.engine.stats()["prefix_cache_hits"] > hits and got.metrics["num_cached_tokens"] == 32
    fresh = LLM(str(ckpt), max_model_len=256, enable_prefix_caching=False, **REF)
    assert got.output_token_ids == fresh.generate(with_images, greedy, use_tqdm=False)[0].output_token_ids


def test_greedy_tokens_with_images_through_preemptions(ckpt, hf):
    """A pool too small for three image prompts at once: requests are preempted and recomputed (their
    images encoded again where evicted), with the tokens of transformers; every slot and block back."""
    prompt, sizes = TWO
    images = [_image(*s) for s in sizes]
    want = _hf_greedy(hf, prompt, images)
    request = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
    tight = LLM(str(ckpt), max_model_len=96, num_kv_blocks=7, block_size=16, enable_prefix_caching=False, **REF)
    outs = tight.generate([request] * 3, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [want] * 3
    assert tight.engine.counters["preemptions"] > 0
    stats = tight.engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0


def test_the_same_text_with_another_image_shares_no_cache_past_it(ckpt):
    """Two prompts alike token for token (the placeholders are all one id) but for their image: the
    second finds no cached block covering the image, and its result is its own."""
    prompt = _prompt([], 1, list(range(60, 100)))   # the image first, then 40 text tokens
    a, b = _image(60, 60, 11), _image(60, 60, 12)
    llm = LLM(str(ckpt), max_model_len=256, block_size=16, mamba_block_size=16, max_logprobs=VOCAB, **REF)
    lp_a, _ = _ours_logprobs(llm, prompt, [a])
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    out_b = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": [b]}}, greedy, use_tqdm=False)[0]
    assert out_b.metrics["num_cached_tokens"] == 0
    again_a = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": [a]}}, greedy, use_tqdm=False)[0]
    assert again_a.metrics["num_cached_tokens"] > 0   # the same image: its blocks are found
    lp_b, _ = _ours_logprobs(LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, **REF), prompt, [b])
    assert rel_rms(lp_a, lp_b) > 1e-3


def test_an_fp8_tower_loads_as_its_dequantized_twin(ckpt, tmp_path):
    """A checkpoint whose tower's linear weights are block-scaled FP8 (`weight_scale_inv`, as FP8
    releases store them) gives the log-probs of the same checkpoint with those weights dequantized,
    bit for bit (the tower runs in the model's dtype)."""
    from safetensors.torch import load_file

    from kdaserve.ops.fp8.reference import dequantize_blocks, quantize_blocks

    fp8, twin = {}, {}
    for name, t in load_file(str(ckpt / "model.safetensors")).items():
        if not name.startswith("model.visual."):
            continue
        if name.endswith(".weight") and t.dim() == 2:
            q, scale = quantize_blocks(t, (128, 128))
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            twin[name] = dequantize_blocks(q, scale, (128, 128))
        else:
            fp8[name] = twin[name] = t
    assert any(k.endswith("_scale_inv") for k in fp8)
    extra = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    a = _copy_with_vision(ckpt, tmp_path / "fp8", fp8, extra)
    b = _copy_with_vision(ckpt, tmp_path / "twin", twin)
    prompt, sizes = ONE
    images = [_image(*size) for size in sizes]
    got, _ = _ours_logprobs(LLM(str(a), max_model_len=256, max_logprobs=VOCAB, **REF), prompt, images)
    want, _ = _ours_logprobs(LLM(str(b), max_model_len=256, max_logprobs=VOCAB, **REF), prompt, images)
    assert torch.equal(got, want)


def test_bad_image_requests_are_named_and_leave_the_engine_clean(ckpt, tmp_path):
    llm = LLM(str(ckpt), max_model_len=256, limit_mm_per_prompt={"image": 2}, **REF)
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    image = _image(40, 40, 1)
    with pytest.raises(ValueError, match=r"holds 2 image placeholder\(s\) .* for 1 image"):
        llm.generate({"prompt_token_ids": _prompt([65], 2, [66]), "multi_modal_data": {"image": [image]}}, greedy)
    with pytest.raises(ValueError, match="too many images: got 3; expected at most 2"):
        llm.generate({"prompt_token_ids": _prompt([65], 3, [66]), "multi_modal_data": {"image": [image] * 3}}, greedy)
    with pytest.raises(ValueError, match="multi_modal_data takes 'image'"):
        llm.generate({"prompt_token_ids": [65], "multi_modal_data": {"video": [image]}}, greedy)
    stats = llm.engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0 and not llm.engine.requests
    # image 0: text only, the tower not even built
    text_only = LLM(str(ckpt), max_model_len=256, limit_mm_per_prompt='{"image": 0}', **REF)
    assert text_only.engine.runner.model.visual is None
    with pytest.raises(ValueError, match=r"takes no images \(--limit-mm-per-prompt has image 0\)"):
        text_only.generate({"prompt_token_ids": _prompt([65], 1, [66]), "multi_modal_data": {"image": [image]}}, greedy)


@pytest.mark.parametrize("images", [True, False], ids=["tower", "text-only"])
def test_the_capacity_check_counts_the_tower_it_builds(monkeypatch, images):
    """The startup check weighs the vision tower's tensors (whole on every rank) where the model is
    built with images, and only then: exactly the parameters the built tower has."""
    import kdaserve.models.loader as loader
    from kdaserve.models.capacity import _replicated, parameter_count

    seen = {}
    monkeypatch.setattr(loader, "check_weights_fit", lambda name, shapes, *a, **k: seen.update(shapes))
    llm = LLM("glm-tiny", max_model_len=64, **REF, limit_mm_per_prompt=None if images else {"image": 0})
    tower = {n: s for n, s in seen.items() if n.startswith("model.visual.")}
    model = llm.engine.runner.model
    assert (model.visual is not None) == images
    assert parameter_count(tower) == (sum(p.numel() for p in model.visual.parameters()) if images else 0)
    assert all(_replicated(n) for n in tower)


@pytest.mark.parametrize("budget", [256, 16], ids=["one-step", "chunked"])
def test_mtp_reads_the_images_embeddings_where_the_next_token_is_an_image_token(budget):
    """The MTP layer's row i reads the embedding of the token at i + 1: before and inside an image,
    the image's embedding (as the target read it), not the placeholder token's; also where a
    16-token chunk ends inside the image (the next chunk's first row, read from the encoder cache)."""
    llm = LLM("glm-tiny", max_model_len=256, max_num_batched_tokens=budget,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **REF)
    model = llm.engine.runner.model
    seen = []   # one MTP pass per step with one draft: the prompt's rows in order, then one a decode
    model.mtp.enorm.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    image = _image(60, 90, 1)
    prompt = {"prompt": "<|user|>\nLook: <|begin_of_image|><|image|><|end_of_image|> and say\n<|assistant|>\n",
              "multi_modal_data": {"image": image}}
    out = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    start, n = ids.index(model.image_token_id), ids.count(model.image_token_id)
    assert budget == 256 or (start % budget and (start + n) // budget > start // budget)   # a chunk ends inside
    done = process_image(image, model.image_rules)
    with torch.no_grad():
        want = model.encode_images(torch.from_numpy(done.pixel_values).to(llm.engine.runner.device), [done.grid_thw])
    rows = torch.cat(seen)[: len(ids)]
    torch.testing.assert_close(rows[start - 1 : start - 1 + n], want, rtol=0, atol=1e-6)
    token = model.model.embed_tokens.weight
    assert torch.equal(rows[start + n - 1], token[ids[start + n]])   # the end bracket: its token
