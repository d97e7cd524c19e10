"""Grammars compiled against the model's vocabulary with xgrammar, cached by their source.

The vocabulary xgrammar sees: every token's text (byte-level vocabularies decoded by xgrammar
itself), sized to the model's logits (a padded vocabulary's extra ids are never allowed), with
the checkpoint's special tokens as empty strings, so no grammar can emit an end-of-turn or tool
marker inside a JSON string. The model's end tokens are the grammar's stop tokens: once a
grammar is complete, only they may follow."""

from __future__ import annotations

import json
import re

from kdaserve.engine.structured_output.params import StructuredOutputsParams

# xgrammar's cache of compiled grammars (bytes); vLLM's default (VLLM_XGRAMMAR_CACHE_MB) is 512 MB.
DEFAULT_CACHE_BYTES = 512 << 20


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(f"structured output needs the `xgrammar` package (pip install 'kdaserve[serve]'): {exc}") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (string literals escaped as EBNF wants)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(s: str) -> str:
        return "".join(escapes.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in s)

    return "root ::= " + " | ".join(f'"{literal(c)}"' for c in choices)


def looks_like_lark(grammar: str) -> bool:
    """EBNF rules use `::=`; a grammar with none is read as Lark (vLLM's rule)."""
    for line in grammar.splitlines():
        line = line.split("#", 1)[0].split("//", 1)[0].strip()
        if "::=" in line:
            return False
    return True


def tokenizer_info(xgr, tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of `tokenizer`, `vocab_size` wide (the logits' width)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:   # the byte tokenizer: ids below 256 are bytes, the rest special
        vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    from transformers import PreTrainedTokenizerFast

    # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback, raw) from a
    # transformers tokenizer; the vocabulary itself is rebuilt with the special tokens emptied.
    detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                  vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    vocab = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, detected.dump_metadata())


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[hh:mm:ss] file.cc:83: ")."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)


# JSON's optional whitespace between tokens, at most this many characters in a row: a small model
# otherwise writes "{" then whitespace until max_tokens. 16 still lets pretty-printed JSON nest
# (a newline and 4 levels of 4-space indent). The engine flag --structured-outputs-max-whitespace.
DEFAULT_MAX_WHITESPACE = 16


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` once (thread-safe: the server compiles in worker threads)
    and makes one matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_bytes: int = DEFAULT_CACHE_BYTES,
                 max_whitespace: int = DEFAULT_MAX_WHITESPACE):
        """`max_whitespace`: --structured-outputs-max-whitespace (0: unbounded)."""
        xgr = self._xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace or None
        self.stop_token_ids = sorted(stop_token_ids)
        info = tokenizer_info(xgr, tokenizer, vocab_size, self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=cache_bytes)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (kept on `params`); ValueError naming what is wrong with it."""
        if params.compiled is not None:
            return params.compiled
        c, kind = self._compiler, params.kind
        whitespace = {"any_whitespace": not params.disable_any_whitespace,
                      "separators": (",", ":") if params.disable_any_whitespace else None,
                      "max_whitespace_cnt": None if params.disable_any_whitespace else self.max_whitespace}
        try:
            if kind == "json":
                compiled = c.compile_json_schema(params.json, **whitespace)
            elif kind == "json_object":
                compiled = c.compile_json_schema(json.dumps({"type": "object"}), **whitespace)
            elif kind == "regex":
                compiled = c.compile_regex(params.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(choice_grammar(params.choice))
            elif looks_like_lark(params.grammar):
                compiled = c.compile_lark(params.grammar)
            else:
                compiled = c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured_outputs.{kind}: {_reason(exc)}") from None
        params.compiled = compiled
        return compiled

    def matcher(self, params: StructuredOutputsParams):
        return self._xgr.GrammarMatcher(self.compile(params))

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32
