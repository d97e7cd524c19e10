"""--generation-config: a checkpoint's sampling defaults fill what a request leaves out."""

from __future__ import annotations

import json

import pytest

from kdaserve.server.generation_config import load_generation_defaults


def test_auto_reads_the_checkpoints_file_and_vllm_ignores_it(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}))
    assert load_generation_defaults("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert load_generation_defaults("vllm", str(tmp_path)) == {}
    assert load_generation_defaults("auto", "tiny") == {}                  # a built-in model: no file
    assert load_generation_defaults(str(tmp_path), "tiny")["top_k"] == 20  # a folder named explicitly


def test_a_missing_or_unusable_file_is_a_startup_error(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        load_generation_defaults(str(tmp_path), "tiny")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="sampling defaults no request could use: invalid temperature"):
        load_generation_defaults("auto", str(tmp_path))


def test_defaults_apply_where_the_request_is_silent():
    from fastapi.testclient import TestClient
    from server_helpers import make_engine

    from kdaserve.server.app import build_app

    app = build_app(make_engine(), sampling_defaults={"temperature": 0.0, "max_tokens": 3})
    with TestClient(app) as http:
        def complete(**body):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0], r.json()["usage"]

        (a, usage), (b, _) = complete(), complete()
        assert usage["completion_tokens"] == 3 and a["text"] == b["text"], "greedy and 3 tokens from the defaults"
        _, usage = complete(max_tokens=5)
        assert usage["completion_tokens"] == 5, "the request's own value wins"
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                       "ignore_eos": True})
        assert chat.json()["usage"]["completion_tokens"] == 3
