"""`fused` decode backend: the whole KDA decode step of a layer in one Triton launch.

Same calling convention as `kdaserve.ops.reference.kda_decode_reference` (see its docstring):
plain decode (one token per sequence) and speculative verify (S+1 tokens per sequence with
`spec_state_indices` / `num_accepted_tokens`) both run in the one kernel. Only tensor metadata is
inspected on the host (no device->host sync), so a call is CUDA-graph capturable.

The conv weight is read in the derived `[3, W, P]` layout (`fused_conv_weight_layout`) from
`weights.conv_weight_decode`; when that is unset it is derived on every call: correct but slower
(one extra copy kernel per call), so layers should own and refresh the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.ops.checks import check_common, check_decode
from kdaserve.ops.fused.conv_weight import fused_conv_weight_layout
from kdaserve.ops.fused.decode_kernel import kda_fused_decode_kernel
from kdaserve.ops.types import KDAWeights, conv_state_rows

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Up to about one program per SM of an H100/H200 (132 SMs) the whole-state-in-registers shape wins
# on latency; above it the streamed shape wins on bandwidth (benchmarks/bench_decode.py sweeps both).
SMALL_BATCH_PROGRAMS = 128


@dataclass(frozen=True, slots=True)
class FusedDecodeConfig:
    """Launch shape. block_v=None keeps the whole [V, K] state of a head in registers (required for
    speculative verify); a smaller power of two streams it in [block_v, K] blocks."""

    block_v: int | None = None
    num_warps: int = 8
    num_stages: int = 1


def default_config(head_dim: int, tokens_per_seq: int, programs: int) -> FusedDecodeConfig:
    """Launch shape by batch size (N*H programs). Register counts from sm_90 builds at D=128, fp32
    state (docs/fused-decode.md): whole state in registers with 8 warps needs ~192 registers a
    thread, one program per SM, but issues every state load at once (one DRAM round trip: best
    when latency-bound, fewer programs than SMs); [32, K] blocks with 4 warps need ~80, six
    programs per SM, and pipeline the blocks (best when bandwidth-bound). Speculative verify keeps
    the state in registers across its tokens."""
    if tokens_per_seq > 1 or programs <= SMALL_BATCH_PROGRAMS or head_dim <= 32:
        return FusedDecodeConfig(block_v=None, num_warps=8 if head_dim >= 64 else 4)
    return FusedDecodeConfig(block_v=32, num_warps=4, num_stages=2)


def _fail(msg: str) -> None:
    raise ValueError(f"fused decode: {msg}")


def _as_heads(t: torch.Tensor, T: int, H: int, D: int, name: str) -> torch.Tensor:
    """[T, H, D] view with contiguous D (a copy only for exotic strides)."""
    v = t.reshape(T, H, D)
    return v if v.stride(2) == 1 else v.contiguous()


def kda_decode_fused(
    qkv: torch.Tensor,
    g1: torch.Tensor,
    beta_logits: torch.Tensor,
    g2: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    *,
    conv_layout: str = "SD",
    spec_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
) -> None:
    """One launch per layer per step; see the module docstring and kda_decode_reference."""
    launch_fused_decode(
        None, qkv, g1, beta_logits, g2, weights, conv_state, recurrent_state, state_indices, out,
        conv_layout=conv_layout, spec_state_indices=spec_state_indices, num_accepted_tokens=num_accepted_tokens,
    )


def launch_fused_decode(
    config: FusedDecodeConfig | None,
    qkv: torch.Tensor,
    g1: torch.Tensor,
    beta_logits: torch.Tensor,
    g2: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    *,
    conv_layout: str = "SD",
    spec_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
) -> None:
    """kda_decode_fused with an explicit launch shape (None = default_config); benchmarks sweep it."""
    T, H, D = check_common(qkv, g1, beta_logits, g2, weights, conv_state, recurrent_state, out, conv_layout)
    rows = conv_state_rows(conv_state, conv_layout)
    W = weights.conv_width
    N, tokens = check_decode(T, state_indices, spec_state_indices, num_accepted_tokens, rows.shape[1], W)
    if W != 4:
        _fail(f"the kernel is written for the width-4 conv, got conv_weight with W={W}")
    if D & (D - 1) or D < 4:
        _fail(f"head_dim must be a power of two >= 4, got {D}")
    if recurrent_state.dtype not in STATE_DTYPES:
        _fail(f"recurrent_state must be one of {STATE_DTYPES}, got {recurrent_state.dtype}")
    for name, t in (("out", out), ("conv_state", conv_state)):
        if t.dtype not in IO_DTYPES:
            _fail(f"{name} must be one of {IO_DTYPES}, got {t.dtype}")
    if recurrent_state.stride(3) != 1:
        _fail(f"recurrent_state must have K contiguous (stride 1 on the last dim), got strides {recurrent_state.stride()}")
    if weights.lower_bound is not None and not -5.0 <= weights.lower_bound < 0.0:
        _fail(f"lower_bound must lie in [-5, 0) or be None (unbounded gate), got {weights.lower_bound}")
    cfg = config or default_config(D, tokens, N * H)
    block_v = cfg.block_v or D
    if block_v & (block_v - 1) or not 1 <= block_v <= D:
        _fail(f"block_v must be a power of two in [1, {D}], got {block_v}")
    if tokens > 1 and block_v != D:
        _fail("speculative verify needs the whole state in registers (block_v=None)")
    try:
        out_v = out.view(T, H, D)
    except RuntimeError:
        out_v = None
    if out_v is None or out_v.stride(2) != 1:
        _fail(f"out must be viewable as [T, H, D] with D contiguous, got shape {tuple(out.shape)} strides {out.stride()}")
    if N == 0:
        return

    conv_w = weights.conv_weight_decode
    if conv_w is None:
        conv_w = fused_conv_weight_layout(weights.conv_weight)  # slower: a copy on every call
    elif tuple(conv_w.shape) != (3, W, H * D) or conv_w.dtype != torch.float32 or not conv_w.is_contiguous():
        _fail(
            f"weights.conv_weight_decode must be contiguous fp32 [3, W, P] = [3, {W}, {H * D}] "
            f"(built by fused_conv_weight_layout), got {conv_w.dtype} {tuple(conv_w.shape)}"
        )
    g1_v, g2_v = _as_heads(g1, T, H, D, "g1"), _as_heads(g2, T, H, D, "g2")
    spec = spec_state_indices if spec_state_indices is not None else state_indices.view(N, 1)
    accepted = num_accepted_tokens if num_accepted_tokens is not None else state_indices
    lb = weights.lower_bound

    kda_fused_decode_kernel[(N * H,)](
        qkv, g1_v, beta_logits, g2_v, conv_w,
        weights.A_log.contiguous(), weights.dt_bias.contiguous(), weights.norm_weight.contiguous(),
        conv_state, recurrent_state, state_indices, spec, accepted, out_v,
        qkv.stride(0), g1_v.stride(0), g1_v.stride(1), beta_logits.stride(0), beta_logits.stride(1),
        g2_v.stride(0), g2_v.stride(1),
        rows.stride(0), rows.stride(1), rows.stride(2),
        recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        spec.stride(0), spec.stride(1), out_v.stride(0), out_v.stride(1),
        0.0 if lb is None else float(lb), float(weights.norm_eps),
        H=H, D=D, L=rows.shape[1], TOKENS=tokens, SCALE=D**-0.5,
        IS_SPEC=spec_state_indices is not None, BOUNDED_GATE=lb is not None,
        BV=block_v, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
    )
