"""Kimi's tiktoken vocabulary format, converted without running checkpoint code: a small BPE
vocabulary trained and written by the test, then every text encoded by kdaserve's tokenizer equals
tiktoken's own encoding with the same ranks, pattern and special tokens; decode round-trips."""

from __future__ import annotations

import json

import pytest

tiktoken = pytest.importorskip("tiktoken")
pytest.importorskip("transformers")

from kdaserve.models.tiktoken_vocab import KIMI_PATTERN, special_tokens
from kdaserve.models.tokenizer import HFTokenizer, load_checkpoint_tokenizer

CORPUS = ("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
          "The Quick brown fox's tail, isn't it? We'll see: 12345 apples, 3.14159 pies.\n"
          "KDA 是一种线性注意力。Kimi Linear 混合了 KDA 和 MLA 层。\n\n\n   indented\ttabs\r\n") * 3
TEXTS = ["Hello, World!", "fibonacci(10) + 2025", "It's THE end — don't PANIC", "混合了 KDA 和 MLA",
         "   spaces\n\n\nand lines\r\n", "camelCaseWords ALLCAPS MixedUP", "émoji 🙂 and ünïcödé", ""]


def _ranks():
    """Byte ranks plus merges learned greedily from CORPUS (enough to exercise real merges). The
    trainer splits with Python's `regex`, which reads Kimi's `&&` class intersections otherwise than
    tiktoken and tokenizers do, so it splits by a plain pattern; encoding uses Kimi's on both sides."""
    from tiktoken._educational import bpe_train

    return bpe_train(CORPUS, 256 + 60, r"""\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+""", visualise=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import base64

    path = tmp_path_factory.mktemp("kimi_tok")
    ranks = _ranks()
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")   # the format tiktoken.load reads
    n = len(ranks)
    config = {"tokenizer_class": "TikTokenTokenizer", "eos_token": "[EOS]", "num_reserved_special_tokens": 8,
              "added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"},
                                       str(n + 3): {"content": "<|im_end|>"}},
              "chat_template": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path, ranks, config


def test_encoding_equals_tiktoken(checkpoint):
    path, ranks, config = checkpoint
    specials = special_tokens(config, len(ranks))
    ref = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    tok = load_checkpoint_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS + [CORPUS]:
        want = ref.encode(text, disallowed_special=())
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text
    assert tok.vocab_size == len(ranks) + 8
    assert tok.eos_token_id == len(ranks) + 1


def test_specials_and_reserved_ids_follow_the_ranks(checkpoint):
    path, ranks, config = checkpoint
    n = len(ranks)
    tok = load_checkpoint_tokenizer(path)
    assert tok._tok.token_to_id("[BOS]") == n and tok._tok.token_to_id("<|im_end|>") == n + 3
    assert tok._tok.token_to_id(f"<|reserved_token_{n + 2}|>") == n + 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_user|>hi<|im_end|>"
    with pytest.raises(ValueError, match="outside the ids after the"):
        special_tokens({"added_tokens_decoder": {"3": {"content": "[X]"}}}, n)
