"""Incremental detokenization: the DecodeStream path (checkpoint tokenizers) gives, call by call,
the text of the window path (the definition), and the final text is the whole output's decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import kdaserve
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.models.tokenizer import ByteTokenizer, HFTokenizer, load_checkpoint_tokenizer

TEXT = ("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
        "ünïcödé, 日本語のテキスト, emoji 🎉🐍 and a tab\tend. ") * 3


class WindowOnly:
    """The same tokenizer without its `tokenizers` backend: the window path."""

    def __init__(self, tok):
        self.tok, self.vocab_size = tok, tok.vocab_size

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def bpe_with_merges() -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return HFTokenizer("unused", eos_token_id=0, tokenizer=tok)


def tokenizers():
    nano = load_checkpoint_tokenizer(Path(kdaserve.__file__).parent / "models" / "nano")
    return {"nano-bytes": nano, "bpe-merges": bpe_with_merges(), "builtin-bytes": ByteTokenizer()}


def outputs(tok, rng: random.Random) -> list[int]:
    """Encoded text cut anywhere (inside characters too), with special and out-of-vocabulary ids."""
    ids = tok.encode(TEXT)
    a = rng.randrange(len(ids) // 2)
    out = ids[a : a + rng.randrange(5, len(ids) - a)]
    for _ in range(3):
        out.insert(rng.randrange(len(out) + 1), rng.choice([tok.eos_token_id or 0, tok.vocab_size + 7]))
    return out


@pytest.mark.parametrize("name", ["nano-bytes", "bpe-merges", "builtin-bytes"])
def test_stream_gives_the_window_text_at_every_call(name):
    tok = tokenizers()[name]
    assert getattr(tok, "detokenizer_backend", None) or tok.backend is not None
    for seed in range(40):
        rng = random.Random(seed)
        prompt = tok.encode("prompt: ")
        ids = prompt + outputs(tok, rng)
        stop = [rng.choice(["fibonacci(n - 2)", "日本", "🐍 and", "never there"])] if seed % 3 == 0 else []
        fast, slow = IncrementalDetokenizer(tok, stop), IncrementalDetokenizer(WindowOnly(tok), stop)
        assert fast._stream is not None and slow._stream is None
        end = len(prompt)
        while end < len(ids):
            end = min(len(ids), end + rng.choice([1, 1, 1, 2, 5]))   # several tokens at once: a verify's
            final = end == len(ids)
            hit = fast.add(ids, final=final, start=len(prompt), end=end)
            assert hit == slow.add(ids, final=final, start=len(prompt), end=end), (seed, end)
            assert fast.text == slow.text, (seed, end)
            if hit is not None:
                break
        else:
            assert fast.text == tok.decode(ids[len(prompt):]), seed   # the whole output, a cut character too


def test_the_end_emits_a_character_the_output_cut_in_half():
    tok = tokenizers()["nano-bytes"]
    ids = tok.encode("ab日")[:-1]          # 'a', 'b' and two of the three bytes of 日
    d = IncrementalDetokenizer(tok, [])
    d.add(ids, end=2)
    d.add(ids, end=len(ids))
    assert d.text == "ab"                 # held back while it may still complete
    d.add(ids, final=True, end=len(ids))
    assert d.text == tok.decode(ids) == "ab\ufffd"
