"""Tokenizers: a byte-level one for the built-in models (no files needed) and a wrapper around a
checkpoint's `tokenizer.json` or tiktoken vocabulary (the `tokenizers` library). Both expose what the engine and the
server use: encode, decode, eos_token_id, vocab_size, apply_chat_template."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

# A chat template is code from a checkpoint (or --chat-template): its output, the size of anything
# it builds and its time are bounded, so a hostile or broken one costs a 400, not the server's
# memory or a thread (jinja2's sandbox bounds each range, not their product nor how much they print).
MAX_TEMPLATE_OUTPUT_CHARS = 1 << 24
MAX_TEMPLATE_SECONDS = 10.0
# A power's exponent, past which one `**` could run for minutes inside a single expression.
MAX_TEMPLATE_EXPONENT = 4096

_render_limits = threading.local()   # (deadline, max_chars, max_seconds) of the render on this thread


def _check_deadline() -> None:
    limits = getattr(_render_limits, "value", None)
    if limits is not None and time.monotonic() > limits[0]:
        raise ValueError(f"the chat template took more than {limits[2]:g} s to render")


def _check_size(n: int, what: str) -> None:
    limits = getattr(_render_limits, "value", None)
    if limits is not None and n > limits[1]:
        raise ValueError(f"the chat template asked for {what} of {n}, over the limit of {limits[1]} characters")


class _BoundedRange:
    """jinja2's sandboxed range (at most MAX_RANGE items), checking the render's deadline at every
    item: nested loops that print nothing would otherwise spin for hours. A range otherwise
    (length, indexing, membership, reversed)."""

    def __init__(self, *args: int):
        from jinja2.sandbox import safe_range

        self._range = safe_range(*args)

    def __iter__(self):
        for i in self._range:
            _check_deadline()
            yield i

    def __reversed__(self):
        for i in reversed(self._range):
            _check_deadline()
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, i):
        return self._range[i]

    def __contains__(self, x) -> bool:
        return x in self._range


def _checked_args(args, kwargs) -> None:
    """No integer argument past the output limit (str.ljust / center / zfill / indent with a huge
    width allocate it at once), and the deadline."""
    _check_deadline()
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            _check_size(abs(a), "a width or count")


@functools.lru_cache(maxsize=1)
def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox with the work of each operation bounded: `*` and `+` may not build a
        string or list past the output limit, `**` takes a bounded exponent, calls and filters take
        no huge width or count, and ranges and calls check the render's deadline."""

        intercepted_binops = frozenset(["*", "+", "**"])

        def __init__(self, **kw):
            super().__init__(**kw)
            self.globals["range"] = _BoundedRange
            self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * max(n, 0), "a string or list")
            elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
                _check_size(len(left) + len(right), "a string or list")
            elif operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_TEMPLATE_EXPONENT:
                raise ValueError(f"the chat template raises to the power {right}, over {MAX_TEMPLATE_EXPONENT}")
            _check_deadline()
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja2's own signature)
            _checked_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


def _bounded_filter(f):
    # The filtered value comes first, after the context / environment where jinja2 passes one: only
    # the filter's own arguments (a width, a count) are bounded, not the value (a big id is fine).
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1

    @functools.wraps(f)   # keeps jinja2's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _checked_args(args[skip:], kwargs)
        return f(*args, **kwargs)
    return bounded


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment_class()(trim_blocks=True, lstrip_blocks=True).from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, *,
                         max_chars: int = MAX_TEMPLATE_OUTPUT_CHARS, max_seconds: float = MAX_TEMPLATE_SECONDS,
                         **variables) -> str:
    """A jinja2 chat template, rendered in jinja2's immutable sandbox (no attribute access outside
    it, no mutation of what it is given), compiled once per template. Raises ValueError past
    `max_chars` of output (or of one string or list it builds) or `max_seconds` (checked as output
    is produced, at every item of a range, every call and every bounded operator)."""
    pieces, size, t0 = [], 0, time.monotonic()
    outer = getattr(_render_limits, "value", None)
    _render_limits.value = (t0 + max_seconds, max_chars, max_seconds)
    try:
        for piece in _compiled(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **variables):
            size += len(piece)
            if size > max_chars:
                raise ValueError(f"the chat template rendered more than {max_chars} characters")
            _check_deadline()
            pieces.append(piece)
    finally:
        _render_limits.value = outer
    return "".join(pieces)


# An image part's placeholder (GLM-5.3-Flash's: the image token between its brackets).
IMAGE_SPECIALS = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>")
IMAGE_PLACEHOLDER = "".join(IMAGE_SPECIALS)


def _content_text(content) -> str:
    """A message's content: its text, or its parts' (vLLM's {"type": "image"} parts as the placeholder)."""
    if isinstance(content, str):
        return content
    return "".join(IMAGE_PLACEHOLDER if p.get("type") == "image" else p.get("text", "") for p in content)


def _simple_chat_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A template for models that ship none: role markers from the byte tokenizer's specials."""
    text = "".join(f"<|{m['role']}|>\n{_content_text(m['content'])}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


# The same as jinja2, for clients that render prompts themselves (`/tokenizer_info`).
SIMPLE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{% if m.content is string %}{{ m.content }}{% else %}"
                        "{% for p in m.content %}{% if p.type == 'image' %}" + IMAGE_PLACEHOLDER + "{% else %}"
                        "{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ByteTokenizer:
    """Token i < 256 is byte i; then a few special tokens. Text round-trips exactly (UTF-8).
    `image_tokens`: also the image placeholder and its brackets (a built-in vision model's)."""

    SPECIALS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")

    def __init__(self, image_tokens: bool = False):
        self.specials = self.SPECIALS + (IMAGE_SPECIALS if image_tokens else ())
        self.special_ids = {s: 256 + i for i, s in enumerate(self.specials)}
        self.eos_token_id = self.special_ids["<|endoftext|>"]
        self.bos_token_id = None
        self.vocab_size = 256 + len(self.specials)
        self.chat_template: str | None = None   # `serve --chat-template` may set one

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            j = text.find("<|", i)
            if j < 0:
                j = len(text)
            ids.extend(text[i:j].encode("utf-8"))
            if j == len(text):
                break
            for s, sid in self.special_ids.items():
                if text.startswith(s, j):
                    ids.append(sid)
                    i = j + len(s)
                    break
            else:
                ids.extend(b"<|")
                i = j + 2
        return ids

    @property
    def special_token_strings(self) -> tuple[str, ...]:
        return self.specials

    @property
    def detokenizer_backend(self):
        """The same tokenizer as a `tokenizers.Tokenizer` (to_tokenizers_json), for the engine's
        incremental detokenizer: it then takes one DecodeStream call per sequence and step, as
        with a checkpoint's tokenizer, instead of two window decodes in Python (engine/
        detokenizer.py; the same text, tested). Not `backend`: structured output reads that one
        as a checkpoint's vocabulary, and the byte vocabulary has its own path there."""
        tok = self.__dict__.get("_detokenizer_backend")
        if tok is None:
            from tokenizers import Tokenizer

            tok = self._detokenizer_backend = Tokenizer.from_str(self.to_tokenizers_json())
        return tok

    def info(self) -> dict:
        """What `/tokenizer_info` reports (remote tokenizers such as lm-eval's read it)."""
        return {"tokenizer_class": type(self).__name__, "eos_token": "<|endoftext|>", "bos_token": None,
                "pad_token": None, "unk_token": None, "chat_template": self.chat_template or SIMPLE_CHAT_TEMPLATE,
                "vocab_size": self.vocab_size}

    def token_to_id(self, token: str) -> int | None:
        """A special token's id (bytes have no string of their own here)."""
        return self.special_ids.get(token)

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: a special token's string becomes its bytes, never the token."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if 0 <= t < 256:
                buf.append(t)
            elif not skip_special_tokens and t < self.vocab_size:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(self.specials[t - 256])
            # ids past the tokenizer (a model's padded vocab) have no text
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.chat_template:
            return render_chat_template(self.chat_template, messages, add_generation_prompt, **kwargs)
        return _simple_chat_template(messages, add_generation_prompt)

    def to_tokenizers_json(self) -> str:
        """The same tokenizer as a `tokenizer.json` (byte-level BPE without merges, ids = bytes),
        so a saved built-in model loads back through the checkpoint path unchanged."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        byte_chars = pre_tokenizers.ByteLevel.alphabet()
        vocab = {char: b for b, char in _bytes_to_unicode().items()}
        assert set(vocab) == set(byte_chars)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(self.specials))
        return tok.to_str()


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class HFTokenizer:
    """A checkpoint's tokenizer.json; eos from config.json or tokenizer_config.json; the chat
    template from tokenizer_config.json (rendered with jinja2), else the simple one."""

    def __init__(self, path: str | Path, eos_token_id: int | list[int] | None = None, tokenizer=None):
        """`tokenizer`: a `tokenizers.Tokenizer` built elsewhere (from a tiktoken vocabulary);
        default: the directory's tokenizer.json."""
        from tokenizers import Tokenizer

        path = Path(path)
        self._tok = tokenizer if tokenizer is not None else Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        self._cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        if isinstance(eos_token_id, list):
            eos_token_id = eos_token_id[0] if eos_token_id else None
        if eos_token_id is None:
            eos = self._cfg.get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = self._cfg.get("chat_template")
        self._text_tok = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` underneath (structured output reads its vocabulary)."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def special_token_strings(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def info(self) -> dict:
        """What `/tokenizer_info` reports: the checkpoint's special tokens and chat template."""
        def token(name: str) -> str | None:
            v = self._cfg.get(name)
            return v.get("content") if isinstance(v, dict) else v

        eos = token("eos_token") or (self._tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None)
        return {"tokenizer_class": self._cfg.get("tokenizer_class") or type(self).__name__, "eos_token": eos,
                "bos_token": token("bos_token"), "pad_token": token("pad_token"), "unk_token": token("unk_token"),
                "chat_template": self.chat_template if isinstance(self.chat_template, str) else SIMPLE_CHAT_TEMPLATE,
                "vocab_size": self.vocab_size}

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: special tokens' strings are split like any text, never matched.
        A second tokenizer with that setting (built once): flipping the shared one's flag would
        race with encodes on other threads."""
        if self._text_tok is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self._tok.to_str())
            tok.encode_special_tokens = True
            self._text_tok = tok
        return self._text_tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not isinstance(self.chat_template, str):
            return _simple_chat_template(messages, add_generation_prompt)
        specials = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in self._cfg.items() if k.endswith("_token")}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **specials, **kwargs)


def load_checkpoint_tokenizer(path: str | Path, eos_token_id=None):
    """A checkpoint directory's tokenizer: `tokenizer.json` (the `tokenizers` library), else a
    tiktoken vocabulary (`tiktoken.model`, Kimi's format; tiktoken_vocab.py), else the byte
    tokenizer (checkpoints written by kdaserve's tests and tools)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path, eos_token_id)
    if (path / "tiktoken.model").is_file():
        from kdaserve.models.tiktoken_vocab import tokenizer_from_tiktoken

        return HFTokenizer(path, eos_token_id, tokenizer=tokenizer_from_tiktoken(path))
    return ByteTokenizer()
