"""Prompt-lookup drafts (vLLM's "ngram" method): find the longest suffix of a sequence's tokens,
between prompt_lookup_min and prompt_lookup_max tokens long, that occurred earlier in the sequence
(prompt and output alike), and propose the tokens that followed its most recent earlier occurrence.
Repetitive work (code edits, quotations, retrieval answers) repeats long spans, so the drafts are
often right; elsewhere nothing matches and nothing is proposed.

Host-only and incremental: each sequence's tokens live in a growing numpy buffer, appended to as
the sequence grows (converting a long list every step would cost more than the search), and the
search compares the newest token against the whole history in one vectorized pass, then extends
only the few candidate matches backwards."""

from __future__ import annotations

import numpy as np

from kdaserve.engine.sequence import Sequence


class TokenHistory:
    """A sequence's token ids as an int64 numpy array that grows with it (amortized O(1) a token)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array of `token_ids`, which only ever grow by append (Sequence's rule)."""
        total = len(token_ids)
        if total < self.n:       # cannot happen under the append-only rule; rebuild rather than trust it
            self.n = 0
        if total > self.buf.shape[0]:
            grown = np.empty(max(total, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n : total] = token_ids[self.n : total]
            self.n = total
        return self.buf[:total]


def propose_ngram(tokens: np.ndarray, lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens` [L] (see the module docstring); [] when no suffix
    of at least `lookup_min` tokens recurs."""
    L = tokens.shape[0]
    if k <= 0 or L < lookup_min + 1:
        return []
    # Candidate ends e < L-1 with tokens[e] == tokens[L-1]; the match length is how far back
    # tokens[e-j] == tokens[L-1-j] holds, up to lookup_max (and the start of the sequence).
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    if ends.size == 0:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, min(lookup_max, L - 1)):
        ok = ends - j >= 0
        idx = np.where(ok, ends - j, 0)
        alive &= ok & (tokens[idx] == tokens[L - 1 - j])
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < lookup_min:
        return []
    e = int(ends[np.flatnonzero(length == best)[-1]])   # the most recent of the longest matches
    return tokens[e + 1 : e + 1 + k].tolist()


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int):
        self.k, self.lookup_min, self.lookup_max = num_speculative_tokens, lookup_min, lookup_max
        self._histories: dict[int, TokenHistory] = {}

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for `seq`'s next verify step, at most min(k, room) of them."""
        n = min(self.k, room)
        if n <= 0:
            return []
        history = self._histories.get(seq.seq_id)
        if history is None:
            history = self._histories[seq.seq_id] = TokenHistory()
        return propose_ngram(history.sync(seq.token_ids), self.lookup_min, self.lookup_max, n)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence's buffer."""
        self._histories.pop(seq.seq_id, None)
