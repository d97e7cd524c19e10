"""Incremental detokenization and stop strings.

Text grows token by token; a token can end inside a multi-byte character (byte-level tokenizers),
so the newest text is held back while it decodes to a trailing U+FFFD. Two ways to find the new
text, with the same result:

- a checkpoint's tokenizer (a `tokenizers.Tokenizer` behind HFTokenizer.backend) and the built-in
  byte tokenizer (ByteTokenizer.detokenizer_backend) decode through the library's `DecodeStream`:
  one call into Rust for a step's new tokens instead of two decodes, which the engine pays once per
  sequence per step (benchmarks/bench_detokenizer.py; docs/perf-notes.md, fifteenth session);
- any other tokenizer decodes a window: the tokens since the previous emitted text plus the window
  before them (so merges across the boundary come out right), keeping the cost per token constant.

At the end of a request, text still held back (a character the output cut in half) is emitted as
the window gives it, U+FFFD included, so the final text is the whole output's."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.prefix_offset = 0     # start of the decode window
        self.read_offset = 0       # tokens whose text is already in self.text
        backend = getattr(tokenizer, "detokenizer_backend", None)
        if backend is None:
            backend = getattr(tokenizer, "backend", None)
        self._backend = backend if isinstance(backend, Tokenizer) else None
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._fed = 0              # tokens given to the stream
        self._vocab = tokenizer.vocab_size

    def add(self, ids: list[int], *, final: bool = False, start: int = 0, end: int | None = None,
            check_stop: bool = True) -> str | None:
        """ids[start:end] (absolute indices): all output tokens so far (stop tokens excluded); the
        engine passes the sequence's whole token list and the bounds, so that no copy of all
        outputs is made per token. Appends the newly complete text (all of it when `final`);
        returns the stop string hit (text trimmed before it), else None. `check_stop=False`
        (before min_tokens) appends without looking for stop strings; a later call still finds one
        that began here."""
        end = len(ids) if end is None else end
        piece = self._from_stream(ids, start, end) if self._stream is not None else None
        if piece is None and (self._stream is None or (final and start + self.read_offset < end)):
            piece = self._from_window(ids, start, end, final)
        if not piece:
            return None
        old_len = len(self.text)
        self.text += piece
        if not self.stop or not check_stop:
            return None
        start = max(0, old_len - self.max_stop_len + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i]
        return s

    def _from_stream(self, ids: list[int], start: int, end: int) -> str | None:
        # Ids past the tokenizer (a model's padded vocabulary) have no text, as in HFTokenizer.decode.
        # One new token (the common case) goes in as an int: the binding takes a list more slowly.
        a, vocab = start + self._fed, self._vocab
        if end - a == 1:
            new = ids[a] if 0 <= ids[a] < vocab else None
        else:
            new = [i for i in ids[a:end] if 0 <= i < vocab] or None
        self._fed = max(self._fed, end - start)
        piece = None if new is None else self._stream.step(self._backend, new)
        if piece is not None:   # the stream has emitted every token given to it
            self.prefix_offset, self.read_offset = self.read_offset, end - start
        return piece

    def _from_window(self, ids: list[int], start: int, end: int, final: bool) -> str | None:
        prefix = self.tokenizer.decode(ids[start + self.prefix_offset : start + self.read_offset])
        full = self.tokenizer.decode(ids[start + self.prefix_offset : end])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, end - start
        return full[len(prefix) :]
