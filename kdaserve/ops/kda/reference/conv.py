"""The short causal convolution (width W, SiLU, no bias) over the merged q|k|v channels.

The conv-state pool holds, per slot, the last L = W-1+S *pre-conv* inputs, oldest first. A step
that brings `m` new rows for a sequence sees the window `hist[offset : offset+W-1] ++ x`, where
`offset` selects the W-1 rows that are true history:

- prefill and plain decode: `offset = L-(W-1)` (the newest W-1 rows);
- after a speculative verify step in which `a` tokens were accepted: `offset = a-1`, because the
  last S+1 rows written by that step were its drafts and only the first `a` of them are real.

The new state is the last L rows of `hist[: offset+W-1] ++ x`: rejected drafts are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.ops.kda.reference.gates import compute_dtype
from kdaserve.ops.kda.types import conv_state_rows


def conv_window(
    x: torch.Tensor, hist: torch.Tensor, weight: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve one sequence's new rows x [m, C] after history hist [L, C].

    Returns (y [m, C] after SiLU, new history [L, C]). Math in fp32 (fp64 for fp64 inputs).
    """
    L, W = hist.shape[0], weight.shape[1]
    m = x.shape[0]
    if not 0 <= offset <= L - (W - 1):
        raise ValueError(f"conv window offset {offset} outside [0, {L - (W - 1)}] for a state of {L} rows")
    if offset + W - 1 + m < L:
        raise ValueError(
            f"{m} new rows after offset {offset} cannot refill a conv state of {L} rows: "
            f"a speculative step must bring S+1 = {L - (W - 1) + 1} rows per sequence"
        )
    dt = compute_dtype(x, hist, weight)
    kept = torch.cat([hist[: offset + W - 1].to(dt), x.to(dt)])
    window = kept[offset : offset + W - 1 + m]
    # y[t] = silu(sum_j w[:, j] * window[t + j]): an unfold over time then a per-channel dot.
    frames = window.unfold(0, W, 1)  # [m, C, W]
    y = F.silu((frames * weight.to(dt)).sum(-1))
    return y, kept[-L:]


def causal_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    conv_layout: str = "SD",
) -> torch.Tensor:
    """Varlen prefill conv over x [T, C] (any strides), updating the conv-state pool in place.

    A sequence starts from its slot's history when `has_initial_state[n]`, else from zeros.
    Sequences whose slot index is <= 0 are skipped: nothing read, nothing written, y rows zero.
    """
    rows = conv_state_rows(conv_state, conv_layout)
    L, W = rows.shape[1], weight.shape[1]
    y = x.new_zeros(x.shape, dtype=compute_dtype(x, weight))
    cu = cu_seqlens.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue
        hist = rows[slot] if bool(has_initial_state[n]) else torch.zeros_like(rows[slot])
        y_seq, new_hist = conv_window(x[cu[n] : cu[n + 1]], hist, weight, offset=L - (W - 1))
        y[cu[n] : cu[n + 1]] = y_seq
        rows[slot] = new_hist.to(rows.dtype)
    return y


def causal_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    conv_layout: str = "SD",
) -> torch.Tensor:
    """Decode conv: x [N*m, C] holds m rows per sequence (1 for decode, S+1 for a speculative verify).

    With `num_accepted_tokens` the window resumes after the accepted rows of the previous verify
    step (see the module docstring); without it, after the newest W-1 rows.
    """
    rows = conv_state_rows(conv_state, conv_layout)
    L, W = rows.shape[1], weight.shape[1]
    N = state_indices.shape[0]
    if N == 0:
        return x.new_zeros(x.shape, dtype=compute_dtype(x, weight))
    if x.shape[0] % N:
        raise ValueError(f"decode conv got {x.shape[0]} rows for {N} sequences: need the same count per sequence")
    m = x.shape[0] // N
    y = x.new_zeros(x.shape, dtype=compute_dtype(x, weight))
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    for n, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue
        offset = accepted[n] - 1 if accepted is not None else L - (W - 1)
        y_seq, new_hist = conv_window(x[n * m : (n + 1) * m], rows[slot], weight, offset)
        y[n * m : (n + 1) * m] = y_seq
        rows[slot] = new_hist.to(rows.dtype)
    return y
