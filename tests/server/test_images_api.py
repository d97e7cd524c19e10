"""Images through the OpenAI API (chat `image_url` parts, server/media.py): a tiny GLM-5.3-Flash with a
vision tower and a chat template that places image parts, served by a real server with the engine in
its own process (kdaserve serve's default) and in a thread.

The answers equal the Python API's for the same rendered prompt and images (that path is checked
against transformers in tests/models/test_glm5_next_image_prompts.py); usage counts the expanded
prompt; data: URLs, file:// under --allowed-local-media-path and http(s) from --allowed-media-domains
(a local HTTP server: CI has no network) are read, everything else is a 400 that names the rule, and
no refusal leaves anything behind in the engine."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("safetensors")

from safetensors.torch import save_file

from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.glm5_next import random_released_tensors
from kdaserve.models.glm5_next_config import Glm5NextConfig
from kdaserve.models.glm5_next_vision import Glm5NextVisionConfig, Glm5NextVisionTower
from kdaserve.models.tokenizer import ByteTokenizer

IMAGE_SPECIALS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>"]   # ids 260, 261, 262
IMAGE_ID = 262
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
          "projection_intermediate_size": 48, "patch_size": 14, "swiglu_limit": 1.5}
TEMPLATE = ("{%- for m in messages -%}<|{{ m.role }}|>\n{%- if m.content is string -%}{{ m.content }}{%- else -%}"
            "{%- for p in m.content -%}{%- if p.type == 'image' -%}<|begin_of_image|><|image|><|end_of_image|>"
            "{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif %}\n{% endfor -%}"
            "{%- if add_generation_prompt -%}<|assistant|>\n{% endif -%}")
ENGINE = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference",
              moe_backend="reference", dtype="float32", max_model_len=256, max_num_seqs=8,
              limit_mm_per_prompt={"image": 2})


def _checkpoint(path):
    path.mkdir(parents=True)
    config = Glm5NextConfig(
        hidden_size=64, num_hidden_layers=2, vocab_size=263, layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"], linear_num_heads=2, linear_head_dim=32,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        v_head_dim=16, index_topk=64, index_head_dim=16, index_n_heads=4, index_kpool=4, hc_mult=2,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=4096, eos_token_id=256, pad_token_id=None, torch_dtype="float32")
    (path / "config.json").write_text(json.dumps({
        "model_type": "glm5_next", "text_config": {**config.to_dict(), "model_type": "glm5_next_text"},
        "vision_config": VISION, "image_token_id": IMAGE_ID, "tie_word_embeddings": False}))
    (path / "preprocessor_config.json").write_text(json.dumps({"min_image_tokens": 4, "max_image_tokens": 16}))
    tok = json.loads(ByteTokenizer().to_tokenizers_json())
    for i, content in enumerate(IMAGE_SPECIALS):
        tok["added_tokens"].append({"id": 260 + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    tensors = {k: v.contiguous() for k, v in random_released_tensors(config, 1, dtype=torch.float32)}
    g = torch.Generator().manual_seed(2)
    tower = Glm5NextVisionTower(Glm5NextVisionConfig.from_dict(VISION), dtype=torch.float32)
    for name, t in tower.state_dict().items():
        tensors["model.visual." + name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    ckpt = _checkpoint(root / "ckpt")
    media_dir = root / "media"
    media_dir.mkdir()
    (media_dir / "a.png").write_bytes(_png(50, 70, 1))
    (root / "outside.png").write_bytes(_png(50, 70, 1))
    web = root / "web"
    web.mkdir()
    (web / "b.png").write_bytes(_png(30, 90, 2))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(web))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield ckpt, media_dir, root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, setup):
    from kdaserve.engine.engine_process import EngineProcess
    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer
    from kdaserve.server.media import MediaSettings

    ckpt, media_dir, _, _ = setup
    kw = dict(model=str(ckpt), **ENGINE)
    engine = EngineProcess(kw) if request.param == "process" else LLMEngine(**kw)
    media = MediaSettings(allowed_local_media_path=media_dir, allowed_media_domains=("127.0.0.1",),
                          max_image_pixels=200 * 200)
    with BackgroundServer(build_app(engine, media=media)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _chat(client, parts, **extra):
    body = {"model": "x", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    body["model"] = client.get("/v1/models").json()["data"][0]["id"]
    return client.post("/v1/chat/completions", json=body)


def test_a_chat_with_images_answers_as_the_python_api(client, setup):
    ckpt = setup[0]
    a, b = _png(50, 70, 1), _png(30, 90, 2)
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": _data_url(a)}},
             {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": _data_url(b)}},
             {"type": "text", "text": "?"}]
    r = _chat(client, parts)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    prompt = choice["prompt_token_ids"]
    assert usage["prompt_tokens"] == len(prompt) and prompt.count(IMAGE_ID) > 2   # expanded placeholders
    llm = LLM(str(ckpt), **ENGINE)
    # The template placed each image between its brackets, in order; the Python API given the same
    # prompt with one placeholder per image expands it alike and answers alike.
    collapsed = [t for i, t in enumerate(prompt) if t != IMAGE_ID or prompt[i - 1] != IMAGE_ID]
    assert llm.tokenizer.decode(collapsed, skip_special_tokens=False) == (
        "<|user|>Look:<|begin_of_image|><|image|><|end_of_image|> and <|begin_of_image|><|image|><|end_of_image|>?"
        "<|assistant|>\n")
    images = [Image.open(io.BytesIO(a)), Image.open(io.BytesIO(b))]
    want = llm.generate({"prompt_token_ids": collapsed, "multi_modal_data": {"image": images}},
                        SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert list(want.prompt_token_ids) == prompt and choice["token_ids"] == list(want.output_token_ids)
    # Streamed, and n = 2 (one encoding shared): the same tokens.
    r = _chat(client, parts, n=2)
    assert [c["token_ids"] for c in r.json()["choices"]] == [choice["token_ids"]] * 2
    with client.stream("POST", "/v1/chat/completions", json={
            "model": client.get("/v1/models").json()["data"][0]["id"], "stream": True, "temperature": 0,
            "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": parts}]}) as s:
        streamed = [t for line in s.iter_lines() if line.startswith("data: {")
                    for c in json.loads(line[6:])["choices"] for t in c.get("token_ids") or []]
    assert streamed == choice["token_ids"]


def test_files_under_the_allowed_path_and_urls_of_allowed_domains(client, setup):
    _, media_dir, _, web = setup
    r = _chat(client, [{"type": "image_url", "image_url": {"url": f"file://{media_dir}/a.png"}}])
    assert r.status_code == 200, r.text
    inline = _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(_png(50, 70, 1))}}])
    assert r.json()["choices"][0]["token_ids"] == inline.json()["choices"][0]["token_ids"]
    r = _chat(client, [{"type": "image_url", "image_url": {"url": f"{web}/b.png"}}])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("part,needle", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}, "not fetched: allowed domains are 127.0.0.1"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "must point under"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}},
     "could not be decoded"),
    ({"type": "image_url", "image_url": {"url": _data_url(_png(300, 300, 3))}}, "at most 40000 are accepted"),
    ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "unsupported image URL scheme 'ftp'"),
    ({"type": "image_url", "image_url": {}}, "needs"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}, "not supported: send text and image_url"),
], ids=["domain", "outside", "base64", "not-an-image", "pixels", "scheme", "no-url", "video"])
def test_bad_images_are_400s_that_name_the_rule(client, server, part, needle):
    r = _chat(client, [{"type": "text", "text": "hi"}, part])
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    _engine_is_clean(client)


def test_too_many_images_and_files_outside_the_allowed_path(client, setup):
    _, _, root, _ = setup
    url = {"type": "image_url", "image_url": {"url": _data_url(_png(40, 40, 1))}}
    r = _chat(client, [url] * 3)
    assert r.status_code == 400 and "too many images: got 3; expected at most 2" in r.json()["error"]["message"]
    r = _chat(client, [{"type": "image_url", "image_url": {"url": f"file://{root}/outside.png"}}])
    assert r.status_code == 400 and "must point under" in r.json()["error"]["message"]
    _engine_is_clean(client)


def _engine_is_clean(client):
    """Nothing running after refusals: a plain request still answers, and the gauges read zero."""
    assert _chat(client, [{"type": "text", "text": "ok"}]).status_code == 200
    metrics = client.get("/metrics").text
    running = [line for line in metrics.splitlines() if line.startswith("kdaserve:num_requests_running")]
    assert running and all(line.endswith(" 0.0") for line in running), running


def test_media_settings_refuse_a_path_that_is_no_directory_and_zero_limits(tmp_path):
    from kdaserve.server.media import MediaSettings

    with pytest.raises(ValueError, match=r"--allowed-local-media-path .*nowhere: not a directory"):
        MediaSettings(allowed_local_media_path=tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"invalid max_image_pixels: got 0; expected >= 1"):
        MediaSettings(max_image_pixels=0)
    assert MediaSettings(allowed_local_media_path=tmp_path).allowed_local_media_path == tmp_path.resolve()
