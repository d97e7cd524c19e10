"""GET /tokenizer_info, as lm-eval's remote tokenizer uses it (its calls, replayed here): the eos
token's string, which /tokenize turns back into the eos id; /detokenize; and a chat template that
renders, client-side, the prompt the server renders itself. Off unless asked for (as vLLM)."""

from __future__ import annotations

import jinja2
import pytest
from fastapi.testclient import TestClient
from server_helpers import make_engine

from kdaserve.server.app import build_app


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def test_off_by_default(engine):
    with TestClient(build_app(engine)) as http:
        assert http.get("/tokenizer_info").status_code == 404


def test_a_remote_tokenizer_works_from_it_alone(engine):
    with TestClient(build_app(engine, enable_tokenizer_info_endpoint=True)) as http:
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == engine.max_model_len
        eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
        assert eos == [engine.output.eos_token_id]
        ids = http.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "héllo"
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        # lm-eval renders with a plain jinja2 Environment (StrictUndefined), then tokenizes the text.
        text = jinja2.Environment(loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined,
                                  keep_trailing_newline=True).from_string(
            info["chat_template"]).render(messages=messages, add_generation_prompt=True)
        client_side = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        server_side = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert client_side == server_side
