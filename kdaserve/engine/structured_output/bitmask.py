"""Each step's grammar masks: the allowed-token bitmask of every row with a grammar, filled on
the host (xgrammar's batch fill, on several threads: one row of a 160K-token vocabulary inside a
JSON string takes ~0.4 ms on one core; overlapping the device's forward pass), moved in one
staged copy with the rows' indices, and applied to those rows' logits on the device (xgrammar's
kernel: Triton on a GPU). Rows without a grammar cost nothing; a step without one skips all of it."""

from __future__ import annotations

import numpy as np
import torch

from kdaserve.engine.sequence import Sequence
from kdaserve.engine.staging import PackedLayout, StagingRing

_FILLER = None   # xgrammar's thread pool for batch fills, made on first use


def _batch_filler(xgr):
    global _FILLER
    if _FILLER is None:
        _FILLER = xgr.BatchGrammarMatcher(max_threads="auto")
    return _FILLER


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence], ring: StagingRing) -> None:
    """Sets to -inf, in place, every logit of `logits` [N, V] that a row's grammar forbids next."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return
    from kdaserve.engine.structured_output.compiler import import_xgrammar

    xgr = import_xgrammar()
    matchers = [seqs[r].grammar for r in rows]

    def fill(views):
        if isinstance(matchers[0], xgr.GrammarMatcher):   # into the staging memory itself: no extra host copy
            _batch_filler(xgr).batch_fill_next_token_bitmask(matchers, views["bitmask"])
        else:   # duck-typed matchers (tests)
            bitmask = torch.from_numpy(views["bitmask"])
            for k, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, k)

    _stage_and_apply(xgr, logits, rows, fill, ring)


def apply_grammar_masks_to_verify_rows(logits: torch.Tensor, groups, ring: StagingRing) -> None:
    """Speculative verify rows (engine/speculative/rejection_sampler.SampleGroup): row t of a
    sequence with a grammar gets the mask of its grammar after the drafts d_1..d_t, which the
    matcher accepts for the fill and rolls back after (the engine cut the drafts to what the
    grammar allows, so every accept succeeds)."""
    plan = [g for g in groups if g.seq.grammar is not None]
    if not plan:
        return
    from kdaserve.engine.structured_output.compiler import import_xgrammar

    xgr = import_xgrammar()
    rows = [g.first_row + t for g in plan for t in range(len(g.drafts) + 1)]

    def fill(views):
        bitmask = torch.from_numpy(views["bitmask"])
        k = 0
        for g in plan:
            m, accepted = g.seq.grammar, 0
            for t in range(len(g.drafts) + 1):
                if t > accepted or m.is_terminated():
                    # After a draft the grammar refused, or one that ended it, the rows are never
                    # used (the draft is rejected, or the request ends): they repeat the last mask.
                    bitmask[k] = bitmask[k - 1]
                else:
                    m.fill_next_token_bitmask(bitmask, k)
                    if t < len(g.drafts) and m.accept_token(g.drafts[t]):
                        accepted += 1
                k += 1
            if accepted:
                m.rollback(accepted)

    _stage_and_apply(xgr, logits, rows, fill, ring)


def _stage_and_apply(xgr, logits: torch.Tensor, rows: list[int], fill, ring: StagingRing) -> None:
    """`fill(views)` writes row k's bitmask into views["bitmask"][k] for logits row rows[k]; then
    one staged copy and the masks applied to those rows."""
    N, V = logits.shape
    R, W = len(rows), (V + 31) // 32
    layout = PackedLayout((("bitmask", torch.int32, (R, W)), ("rows", torch.int64, (R,))))
    i, host = ring.acquire(layout.nbytes)
    views = layout.host_views(host)
    fill(views)
    views["rows"][:] = np.asarray(rows, dtype=np.int64)
    dev = torch.empty(layout.nbytes, dtype=torch.uint8, device=logits.device)
    ring.submit(i, dev, layout.nbytes)
    d = layout.device_views(dev)
    if rows == list(range(N)):
        xgr.apply_token_bitmask_inplace(logits, d["bitmask"], vocab_size=V)
        return
    picked = logits.index_select(0, d["rows"])
    xgr.apply_token_bitmask_inplace(picked, d["bitmask"], vocab_size=V)
    logits.index_copy_(0, d["rows"], picked)
