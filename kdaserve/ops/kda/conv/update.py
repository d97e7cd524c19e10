"""Decode / speculative-verify conv update: m = 1 or S+1 new rows per sequence, state in place.

Design (why):
- One launch, grid (sequences, channel blocks) with sequences on axis x: each program owns one
  sequence's channel block, reads its whole window before writing (update_kernel.py), so the
  in-place shift is race-free at any batch size.
- The window offset comes from `num_accepted_tokens` on the device (speculative resume), never
  from the host: the entry point does no device->host sync and is CUDA-graph capturable (shapes
  only decide the constexpr block sizes).
- y goes in `out`'s dtype: the decode chain passes an fp32 buffer so q/k/v are not rounded to
  16 bits between the conv and the recurrence (a few % of the state's traffic, see chain.py).
"""

from __future__ import annotations

import torch
import triton

from kdaserve.ops.kda.conv.update_kernel import conv_update_kernel
from kdaserve.ops.kda.conv.varlen import _expect, check_conv_inputs
from kdaserve.ops.kda.types import conv_state_rows

BLOCK_C = 256


def causal_conv_update_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    conv_layout: str = "SD",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N*m, 3P] (m rows per sequence) -> y [N*m, 3P]; conv states updated in place.

    Without `num_accepted_tokens` the window starts after the newest W-1 history rows; with it,
    after the first `num_accepted_tokens[n]` rows of the previous verify step, which must lie in
    [1, L-(W-1)+1] (not checked on the device). Rows of sequences whose slot is <= 0 are not
    written and their states are neither read nor written.
    """
    rows = conv_state_rows(conv_state, conv_layout)
    check_conv_inputs(x, weight, rows, out)
    N = state_indices.shape[0]
    T, C = x.shape
    L, W = rows.shape[1], weight.shape[1]
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if N == 0:
        return y
    _expect(T % N == 0, f"conv update got {T} rows for {N} sequences: need the same count per sequence")
    m = T // N
    if num_accepted_tokens is not None:
        # With 1 accepted row the window starts at history row 0, so m rows must refill all L.
        _expect(W - 1 + m >= L,
                f"{m} new rows per sequence cannot refill a conv state of {L} rows: a speculative step brings S+1 = "
                f"{L - (W - 1) + 1}")
        _expect(num_accepted_tokens.shape == (N,),
                f"num_accepted_tokens must be [N] = [{N}], got {tuple(num_accepted_tokens.shape)}")
    s_slot, s_row, s_c = rows.stride()
    conv_update_kernel[(N, triton.cdiv(C, BLOCK_C))](
        x, x.stride(0), weight, weight.stride(0),
        rows, s_slot, s_row, s_c,
        y, y.stride(0),
        state_indices, num_accepted_tokens if num_accepted_tokens is not None else state_indices,
        C, L, m,
        W=W, BM=max(2, triton.next_power_of_2(m)), BL=triton.next_power_of_2(L), BC=BLOCK_C,
        HAS_ACCEPTED=num_accepted_tokens is not None,
    )
    return y
