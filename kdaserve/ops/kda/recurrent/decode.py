"""KDA recurrence for decode and speculative verify, in place on the recurrent-state pool.

Design (why):
- Decode is bound by state traffic (128 KiB per token-head for fp32 read + write): the kernel
  reads each state tile once, keeps it in registers across the S+1 tokens of a verify step, and
  writes it once per destination slot; everything else (q, k, v, forget_logits, b) is ~1% of the bytes.
- l2norm (scale on q), the gate (bounded or softplus) and beta's sigmoid are computed in-kernel
  from the raw conv output and logits: no intermediate tensors, no extra launches.
- (sequence, head, V-tile) on grid axis x; the V-tile shrinks when few sequences run so that
  small batches still spread over the SMs (latency-bound), and grows with the batch to cut
  redundant q/k work (bandwidth-bound).
- Padding rows (slot <= 0; for verify, the row's first slot) return at once: no read, no write.
- Only metadata is inspected on the host: no device->host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.limits import CHAIN
from kdaserve.ops.kda.recurrent.kernel import kda_recurrent_kernel
from kdaserve.ops.kda.types import KDAWeights
from kdaserve.ops.norm.gated_rms_norm import as_head_view
from kdaserve.ops.triton_math import tl_dtype


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def pick_block_v(num_seq_heads: int, V: int) -> int:
    """V-tile per program: 16 rows while fewer than ~1 wave of (sequence, head) pairs, else 32."""
    return min(V, 16 if num_seq_heads < 128 else 32)


def kda_recurrent_fwd(
    y: torch.Tensor,
    forget_logits: torch.Tensor,
    beta_logits: torch.Tensor,
    recurrent_state: torch.Tensor,
    weights: KDAWeights,
    out: torch.Tensor,
    *,
    state_indices: torch.Tensor | None = None,
    spec_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """y [T, 3P] conv output (post-SiLU q|k|v, columns contiguous), forget_logits [T, H, D] or [T, P],
    beta_logits [T, H] (any strides) -> out [T, H, V] pre-norm output (any float dtype).

    Decode: `state_indices` [N], T == N. Verify: `spec_state_indices` [N, S+1] and
    `num_accepted_tokens` [N], T == N*(S+1): start from slot spec[n, acc[n]-1], store the state
    after token j into spec[n, j] (skipped where <= 0). Padding rows' `out` is not written.
    """
    H, D = weights.num_heads, weights.head_dim
    P = H * D
    _expect(y.dim() == 2 and y.shape[1] == 3 * P and y.stride(1) == 1,
            f"y must be [T, 3P] = [T, {3 * P}] with contiguous columns, got {tuple(y.shape)} strides {y.stride()}")
    T = y.shape[0]
    CHAIN.check(head_dim=D, lower_bound=weights.lower_bound, state_dtype=recurrent_state.dtype)
    g = as_head_view(forget_logits, T, H, D, "forget_logits")
    o = as_head_view(out, T, H, D, "out")
    _expect(tuple(beta_logits.shape) == (T, H), f"beta_logits must be [T, H] = [{T}, {H}], got {tuple(beta_logits.shape)}")
    _expect(
        recurrent_state.dim() == 4 and tuple(recurrent_state.shape[1:]) == (H, D, D) and recurrent_state.stride(3) == 1,
        f"recurrent_state must be [num_slots, H, V, K] = [*, {H}, {D}, {D}] with K contiguous, got "
        f"{tuple(recurrent_state.shape)} strides {recurrent_state.stride()}",
    )
    _expect(weights.A_log.shape == (H,) and weights.dt_bias.is_contiguous(), "A_log must be [H] and dt_bias a contiguous [H, D]")
    is_spec = spec_state_indices is not None
    if is_spec:
        _expect(spec_state_indices.dim() == 2 and spec_state_indices.stride(1) == 1,
                f"spec_state_indices must be [N, S+1] with contiguous rows, got {tuple(spec_state_indices.shape)}")
        N, m = spec_state_indices.shape
        _expect(T == N * m, f"speculative verify takes S+1 = {m} tokens per sequence: {T} tokens for {N} sequences")
        _expect(num_accepted_tokens is not None and num_accepted_tokens.shape == (N,),
                f"speculative verify needs num_accepted_tokens [N] = [{N}]")
        idx = spec_state_indices
    else:
        _expect(state_indices is not None, "decode needs state_indices (or spec_state_indices for a verify step)")
        _expect(num_accepted_tokens is None, "num_accepted_tokens is only meaningful with spec_state_indices")
        N, m = state_indices.shape[0], 1
        _expect(T == N, f"decode takes one token per sequence: {T} tokens for {N} state_indices")
        idx = state_indices
    if N == 0:
        return out
    BV = block_v or pick_block_v(N * H, D)
    _expect(D % BV == 0, f"block_v must divide the head dim {D}, got {BV}")
    bound = weights.lower_bound
    kda_recurrent_kernel[(N * H * (D // BV),)](
        y, y.stride(0),
        g, g.stride(0), g.stride(1),
        beta_logits, beta_logits.stride(0), beta_logits.stride(1),
        recurrent_state, recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        o, o.stride(0), o.stride(1),
        weights.A_log, weights.dt_bias,
        idx, idx, idx.stride(0) if is_spec else 0, num_accepted_tokens if is_spec else idx,
        H, float(bound) if bound is not None else 0.0, D**-0.5,
        M=m, K=D, V=D, BV=BV, IS_SPEC=is_spec, BOUNDED=bound is not None,
        GATE_DT=tl_dtype(weights.gate_dtype),
    )
    return out
