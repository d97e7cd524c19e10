"""Checkpoint directories: save a small model, load it back, get the same model."""

import json

import pytest
import torch

pytest.importorskip("safetensors")   # the GPU machine may run without the checkpoint packages
pytest.importorskip("tokenizers")

from kdaserve.backends import KDABackendChoice
from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.builtin import builtin_config
from kdaserve.models.hybrid_config import HybridConfig
from kdaserve.models.loader import load_model, save_checkpoint
from kdaserve.models.random_weights import random_checkpoint
from kdaserve.models.tokenizer import ByteTokenizer, HFTokenizer

REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference")


def test_saved_tiny_loads_back_and_generates_the_same(tmp_path):
    config = builtin_config("tiny")
    save_checkpoint(tmp_path, config, random_checkpoint(config, seed=0), ByteTokenizer())
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = ["Checkpoint round trip", "héllo"]
    builtin = LLM("tiny", max_model_len=64, **REF).generate(prompts, p, use_tqdm=False)
    loaded_llm = LLM(str(tmp_path), max_model_len=64, **REF)
    assert isinstance(loaded_llm.tokenizer, HFTokenizer)
    assert loaded_llm.tokenizer.encode("héllo <|user|>") == ByteTokenizer().encode("héllo <|user|>")
    assert loaded_llm.tokenizer.eos_token_id == ByteTokenizer().eos_token_id
    loaded = loaded_llm.generate(prompts, p, use_tqdm=False)
    assert [o.output_token_ids for o in loaded] == [o.output_token_ids for o in builtin]
    assert [o.text for o in loaded] == [o.text for o in builtin]


def _ckpt(tmp_path, mutate):
    config = builtin_config("tiny")
    tensors = random_checkpoint(config, seed=1)
    mutate(tensors)
    save_checkpoint(tmp_path, config, tensors, ByteTokenizer())


def _load(path):
    return load_model(str(path), dtype=torch.float32, device="cpu", kda=KDABackendChoice("reference", "reference"))


def test_missing_unknown_and_misshaped_tensors_are_errors(tmp_path):
    _ckpt(tmp_path / "a", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match="lacks 1 tensors.*k_proj"):
        _load(tmp_path / "a")
    _ckpt(tmp_path / "b", lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="does not know.*mlp.extra"):
        _load(tmp_path / "b")
    _ckpt(tmp_path / "c", lambda t: t.__setitem__("model.norm.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match="model.norm.weight has shape \\(3,\\); expected \\(64,\\)"):
        _load(tmp_path / "c")


def test_kda_tensors_under_self_attn_and_mtp_layers_load(tmp_path):
    def rename(t):
        for k in [k for k in t if k.startswith("model.layers.0.linear_attn.")]:
            t[k.replace("linear_attn", "self_attn")] = t.pop(k)
        t["model.layers.4.mlp.gate_proj.weight"] = torch.zeros(1)   # an MTP layer past num_hidden_layers
    _ckpt(tmp_path, rename)
    model = _load(tmp_path).model
    ref = random_checkpoint(builtin_config("tiny"), seed=1)
    torch.testing.assert_close(model.model.layers[0].linear_attn.A_log, ref["model.layers.0.linear_attn.A_log"])
    torch.testing.assert_close(
        model.model.layers[1].self_attn.qkv_proj.weight[64:96], ref["model.layers.1.self_attn.k_proj.weight"]
    )


def test_config_round_trips_and_keeps_unknown_keys(tmp_path):
    c = builtin_config("tiny")
    d = c.to_dict() | {"architectures": ["Glm"], "some_new_field": 3}
    (tmp_path / "config.json").write_text(json.dumps(d))
    back = HybridConfig.from_json(tmp_path / "config.json")
    assert back.to_dict() == d and back.extra["some_new_field"] == 3
    with pytest.raises(ValueError, match="layer_types has 3 entries; expected num_hidden_layers = 4"):
        HybridConfig.from_dict(c.to_dict() | {"layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="unknown layer_types"):
        HybridConfig.from_dict(c.to_dict() | {"layer_types": ["mamba"] * 4})


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="neither a built-in"):
        load_model("no-such-model", dtype=torch.float32, device="cpu")


def test_byte_tokenizer_round_trips_and_chat_template():
    t = ByteTokenizer()
    s = "naïve café ✓ <|assistant|>"
    assert t.decode(t.encode(s), skip_special_tokens=False) == s
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>\nhi\n<|assistant|>\n" and t.encode(chat)[0] == 256 + t.SPECIALS.index("<|user|>")


def test_every_eos_id_of_the_config_stops_generation(tmp_path):
    # GLM-style configs list several end tokens (`eos_token_id: [endoftext, <|user|>, <|observation|>]`);
    # generation must stop at any of them, not only at the first.
    prompt, p = "Stop here", SamplingParams(max_tokens=8)
    first = LLM("tiny", max_model_len=64, **REF).generate([prompt], p, use_tqdm=False)[0].output_token_ids[0]
    config = builtin_config("tiny")
    config.eos_token_id = [ByteTokenizer().eos_token_id, first]
    save_checkpoint(tmp_path, config, random_checkpoint(config, seed=0), ByteTokenizer())
    out = LLM(str(tmp_path), max_model_len=64, **REF).generate([prompt], p, use_tqdm=False)[0]
    assert out.output_token_ids == [first] and out.finish_reason == "stop"


def test_tokenizer_flag_replaces_the_models_tokenizer(tmp_path):
    """--tokenizer: a released name with dummy weights, or a built-in, tokenizes with the given
    directory's tokenizer; a directory without one, or one with more ids than the model's
    vocabulary, is a startup error saying so."""
    save_checkpoint(tmp_path, builtin_config("tiny"), random_checkpoint(builtin_config("tiny"), seed=0), ByteTokenizer())
    llm = LLM("tiny", tokenizer=str(tmp_path), max_model_len=64, **REF)
    assert isinstance(llm.tokenizer, HFTokenizer) and llm.tokenizer.encode("héllo") == ByteTokenizer().encode("héllo")
    with pytest.raises(ValueError, match="expected a directory holding tokenizer.json or tiktoken.model"):
        LLM("tiny", tokenizer=str(tmp_path / "nowhere"), max_model_len=64, **REF)
    from tokenizers import Tokenizer, models

    big = tmp_path / "big"
    big.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0")).save(str(big / "tokenizer.json"))
    with pytest.raises(ValueError, match="has 400 tokens but the model's vocabulary has 260"):
        LLM("tiny", tokenizer=str(big), max_model_len=64, **REF)
