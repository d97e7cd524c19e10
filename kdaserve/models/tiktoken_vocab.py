"""Kimi's tokenizer format without running the checkpoint's code: `tiktoken.model` (base64 token
bytes and rank per line) + the special tokens of `tokenizer_config.json`, converted once into a
`tokenizers` object by transformers' TikTokenConverter (the ranks become byte-level BPE merges).

The pre-tokenization pattern lives in the checkpoint's Python tokenizer class, not in its files:
PATTERNS holds it by `tokenizer_class` (a `pat_str` in tokenizer_config.json wins). Special tokens
take the ids after the ranks, as Kimi's class assigns them: `added_tokens_decoder` names some,
`<|reserved_token_{id}|>` fills the rest of the `num_reserved_special_tokens` (256)."""

from __future__ import annotations

import json
from pathlib import Path

# Kimi's TikTokenTokenizer (tokenization_kimi.py of Kimi-Linear and Kimi-K2): Han runs, words
# split at case changes with English contractions, 1-3 digits, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
PATTERNS = {"TikTokenTokenizer": KIMI_PATTERN}
NUM_RESERVED_SPECIAL_TOKENS = 256


def special_tokens(config: dict, num_base_tokens: int) -> dict[str, int]:
    named = {int(i): (v["content"] if isinstance(v, dict) else v) for i, v in config.get("added_tokens_decoder", {}).items()}
    n = int(config.get("num_reserved_special_tokens", NUM_RESERVED_SPECIAL_TOKENS))
    out = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base_tokens, num_base_tokens + n)}
    stray = sorted(i for i in named if not num_base_tokens <= i < num_base_tokens + n)
    if stray:
        raise ValueError(f"tokenizer_config.json names special tokens {stray} outside the ids after the "
                         f"{num_base_tokens} ranks ({num_base_tokens}..{num_base_tokens + n - 1})")
    return out


def tokenizer_from_tiktoken(path: str | Path):
    """A `tokenizers.Tokenizer` equal to the checkpoint's tiktoken encoding (ids included)."""
    try:
        from tiktoken.load import load_tiktoken_bpe
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as exc:
        raise ImportError(f"a tiktoken vocabulary needs the `tiktoken` and `transformers` packages to convert it "
                          f"(pip install 'kdaserve[tiktoken]'): {exc}") from exc
    path = Path(path)
    vocab_file = path / "tiktoken.model"
    cfg_path = path / "tokenizer_config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    pattern = config.get("pat_str") or PATTERNS.get(config.get("tokenizer_class", ""), KIMI_PATTERN)
    num_base = len(load_tiktoken_bpe(str(vocab_file)))
    specials = special_tokens(config, num_base)
    ordered = [t for t, _ in sorted(specials.items(), key=lambda kv: kv[1])]
    tok = TikTokenConverter(vocab_file=str(vocab_file), pattern=pattern, extra_special_tokens=ordered).converted()
    wrong = [(t, i, tok.token_to_id(t)) for t, i in specials.items() if tok.token_to_id(t) != i]
    if wrong:
        raise ValueError(f"special tokens did not get their ids after conversion, e.g. {wrong[:3]}")
    return tok
