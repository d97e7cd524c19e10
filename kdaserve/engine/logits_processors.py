"""What changes the logits before sampling, per request, in vLLM's meaning and order: min_tokens
(EOS and stop_token_ids masked while the request has fewer outputs), logit_bias (added), then the
penalties (repetition on prompt and output tokens: positive logits divided by it, others
multiplied; frequency per occurrence and presence once, on output tokens). Temperature, min_p and
top-k / top-p follow in the sampler. Greedy rows take the argmax of the processed logits;
log-probs stay those of the raw model distribution.

Every entry is a (row, token) pair built on the host from the requests (only rows that asked for
a processor) and staged in one copy; the device applies them with index operations, never a dense
[rows, vocab] mask. A penalized request's token counts are rebuilt each step from its tokens
(O(length) host work, paid only by requests that ask for penalties)."""

from __future__ import annotations

from collections import Counter

import torch

from kdaserve.engine.sequence import Sequence
from kdaserve.engine.staging import StagingRing, stage_lists


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence], stop_ids: frozenset[int],
                            ring: StagingRing) -> torch.Tensor:
    """Processes `logits` [N, V] (fp32, changed in place: pass a copy) for the rows of `seqs`."""
    mask_r, mask_c = [], []
    bias_r, bias_c, bias_v = [], [], []
    rep_r, rep_c, rep_v = [], [], []
    pen_r, pen_c, pen_v = [], [], []
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_logits_processors:
            continue
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))
            mask_r += [row] * len(ends)
            mask_c += sorted(ends)
        if p.logit_bias:
            bias_r += [row] * len(p.logit_bias)
            bias_c += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
        if p.repetition_penalty != 1.0:
            seen = sorted(set(seq.token_ids))
            rep_r += [row] * len(seen)
            rep_c += seen
            rep_v += [p.repetition_penalty] * len(seen)
        if p.presence_penalty or p.frequency_penalty:
            for token, count in Counter(seq.output_token_ids).items():
                pen_r.append(row)
                pen_c.append(token)
                pen_v.append(-(p.frequency_penalty * count + p.presence_penalty))
    i64, f32 = torch.int64, torch.float32
    staged = {name: (dtype, values) for name, dtype, values in (
        ("mask_r", i64, mask_r), ("mask_c", i64, mask_c), ("bias_r", i64, bias_r), ("bias_c", i64, bias_c),
        ("bias_v", f32, bias_v), ("rep_r", i64, rep_r), ("rep_c", i64, rep_c), ("rep_v", f32, rep_v),
        ("pen_r", i64, pen_r), ("pen_c", i64, pen_c), ("pen_v", f32, pen_v)) if values}
    if not staged:
        return logits
    d = stage_lists(ring, logits.device, staged)
    if mask_r:
        logits[d["mask_r"], d["mask_c"]] = float("-inf")
    if bias_r:
        logits.index_put_((d["bias_r"], d["bias_c"]), d["bias_v"], accumulate=True)
    if rep_r:   # (row, token) pairs are unique: a gather, a transform, a scatter
        v = logits[d["rep_r"], d["rep_c"]]
        logits[d["rep_r"], d["rep_c"]] = torch.where(v > 0, v / d["rep_v"], v * d["rep_v"])
    if pen_r:
        logits.index_put_((d["pen_r"], d["pen_c"]), d["pen_v"], accumulate=True)
    return logits


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's largest (min_p [N], 0 = off)."""
    keep = probs >= min_p[:, None] * probs.amax(-1, keepdim=True)
    return torch.where(keep, probs, probs.new_zeros(()))
