"""Incremental detokenization and stop strings.

Text grows token by token; a token can end inside a multi-byte character (byte-level tokenizers),
so the newest text is held back while it decodes to a trailing U+FFFD. Each step decodes only the
tokens since the previous emitted text plus the window before them (so merges across the boundary
come out right), keeping the cost per token constant."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.prefix_offset = 0     # start of the decode window
        self.read_offset = 0       # tokens whose text is already in self.text

    def add(self, ids: list[int], *, final: bool = False, start: int = 0, end: int | None = None,
            check_stop: bool = True) -> str | None:
        """ids[start:end]: all output tokens so far (stop tokens excluded); the engine passes the
        sequence's whole token list and the bounds, so that no copy of all outputs is made per
        token. Appends the newly complete text (all of it when `final`); returns the stop string
        hit (text trimmed before it), else None. `check_stop=False` (before min_tokens) appends
        without looking for stop strings; a later call still finds one that began here."""
        end = len(ids) if end is None else end
        prefix = self.tokenizer.decode(ids[start + self.prefix_offset : start + self.read_offset])
        full = self.tokenizer.decode(ids[start + self.prefix_offset : end])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, end - start
        if not self.stop or not check_stop:
            return None
        start = max(0, old_len - self.max_stop_len + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i]
        return s
