"""Shape, dtype and device checks shared by every KDA op entry point.

They look only at tensor metadata, never at values on the device, so they cost no device->host
sync and are safe inside the hot path and under CUDA-graph capture. Each error says what was wrong
and what would be right.
"""

from __future__ import annotations

import itertools
import math

import torch

from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights, PrefillSeqs, check_conv_layout, conv_state_rows


def _fail(msg: str) -> None:
    raise ValueError(msg)


# Every check below tests its condition first and formats its message only on failure: these run
# once per layer per step, and formatting a dozen shapes and strides into f-strings that are then
# thrown away was most of their cost (kdaserve.ops.kda.host_tables says why host time matters).


def check_common(
    qkv: torch.Tensor,
    forget_logits: torch.Tensor,
    beta_logits: torch.Tensor,
    output_gate_logits: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    out: torch.Tensor,
    conv_layout: str,
) -> tuple[int, int, int]:
    """Checks what prefill and decode share; returns (T, H, D)."""
    check_conv_layout(conv_layout)
    H, D = weights.num_heads, weights.head_dim
    P = H * D
    T = qkv.shape[0]
    if not (qkv.dim() == 2 and qkv.shape[1] == 3 * P):
        _fail(f"qkv must be [T, 3P] = [T, {3 * P}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        _fail(f"qkv columns must be contiguous (a column slice of the projection), got strides {qkv.stride()}")
    for name, t in (("forget_logits", forget_logits), ("output_gate_logits", output_gate_logits)):
        if not (t.shape[0] == T and math.prod(t.shape[1:]) == P):
            _fail(f"{name} must be [T, H, D] or [T, P] with T={T}, P={P}, got {tuple(t.shape)}")
    if beta_logits.shape != (T, H):
        _fail(f"beta_logits must be [T, H] = [{T}, {H}], got {tuple(beta_logits.shape)}")
    if not (out.shape[0] == T and math.prod(out.shape[1:]) == P):
        _fail(f"out must be [T, H, D] with T={T}, H={H}, D={D}, got {tuple(out.shape)}")
    if weights.conv_weight.shape[:1] != (3 * P,):
        _fail(f"conv_weight must be [3P, W] = [{3 * P}, W], got {tuple(weights.conv_weight.shape)}")
    if not (recurrent_state.dim() == 4 and recurrent_state.shape[1:] == (H, D, D)):
        _fail(f"recurrent_state must be [num_slots, H, V, K] = [*, {H}, {D}, {D}], got {tuple(recurrent_state.shape)}")
    rows = conv_state_rows(conv_state, conv_layout)
    if not (rows.dim() == 3 and rows.shape[2] == 3 * P and rows.shape[1] >= weights.conv_width - 1):
        _fail(
            f"conv_state ({conv_layout}) must be "
            + ("[num_slots, W-1+S, 3P]" if conv_layout == "SD" else "[num_slots, 3P, W-1+S]")
            + f" with 3P={3 * P}, W={weights.conv_width}, got {tuple(conv_state.shape)}"
        )
    if conv_state.shape[0] != recurrent_state.shape[0]:
        _fail(f"conv_state and recurrent_state pools must have the same slot count, got {conv_state.shape[0]} and "
              f"{recurrent_state.shape[0]}")
    dev = qkv.device
    tensors = (forget_logits, beta_logits, output_gate_logits, conv_state, recurrent_state, out, weights.conv_weight)
    if any(t.device != dev for t in tensors):
        devices = {t.device for t in (qkv, *tensors)}
        _fail(f"all KDA tensors must be on one device, got {sorted(map(str, devices))}")
    return T, H, D


_last_valid_offsets: tuple[int, ...] | None = None  # every layer of a step passes the same host copy


def check_cu_seqlens_cpu(cu_seqlens_cpu: torch.Tensor | None, N: int, T: int) -> tuple[int, ...] | None:
    """The host copy of cu_seqlens sizes the grids and token ranges of every prefill kernel: one
    that disagrees with the step's T would have kernels read and write past the step's rows. It is
    on the host, so checking its values costs no device sync (a few hundred bytes at most).
    Returns its values as a tuple (what the host tables are built from and keyed on)."""
    global _last_valid_offsets
    if cu_seqlens_cpu is None:
        return None
    if cu_seqlens_cpu.device.type != "cpu":
        _fail(f"cu_seqlens_cpu must be the host (CPU) copy of cu_seqlens, got a tensor on {cu_seqlens_cpu.device}")
    if cu_seqlens_cpu.shape != (N + 1,):
        _fail(f"cu_seqlens_cpu must be [N+1] = [{N + 1}] for {N} sequences, got {tuple(cu_seqlens_cpu.shape)}")
    cu = tuple(cu_seqlens_cpu.tolist())
    # The O(N) order scan runs once per distinct copy (a tuple compare is a C loop, the scan is not).
    if not (cu[0] == 0 and cu[-1] == T and (cu == _last_valid_offsets or all(a <= b for a, b in itertools.pairwise(cu)))):
        shown = list(cu) if len(cu) <= 16 else [*cu[:8], "...", *cu[-4:]]
        _fail(f"cu_seqlens_cpu must run from 0 to T = {T} without decreasing, got {shown}")
    _last_valid_offsets = cu
    return cu


INDEX_DTYPES = (torch.int32, torch.int64)


def check_prefill(
    T: int, cu_seqlens: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> int:
    N = state_indices.shape[0]
    if cu_seqlens.shape != (N + 1,):
        _fail(f"cu_seqlens must be [N+1] = [{N + 1}] for {N} state_indices, got {tuple(cu_seqlens.shape)}")
    check_cu_seqlens_cpu(cu_seqlens_cpu, N, T)
    if has_initial_state.shape != (N,):
        _fail(f"has_initial_state must be [N] = [{N}], got {tuple(has_initial_state.shape)}")
    if not (cu_seqlens.dtype in INDEX_DTYPES and state_indices.dtype in INDEX_DTYPES):
        _fail(f"cu_seqlens and state_indices must be int32 (or int64), got {cu_seqlens.dtype} and {state_indices.dtype}")
    return N


def check_decode(
    T: int,
    state_indices: torch.Tensor,
    spec_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    conv_rows: int,
    conv_width: int,
) -> tuple[int, int]:
    """Returns (N, tokens per sequence)."""
    N = state_indices.shape[0]
    if spec_state_indices is None:
        if T != N:
            _fail(f"decode takes one token per sequence: {T} tokens for {N} state_indices")
        if num_accepted_tokens is not None:
            _fail("num_accepted_tokens is only meaningful with spec_state_indices")
        return N, 1
    if not (spec_state_indices.dim() == 2 and spec_state_indices.shape[0] == N):
        _fail(f"spec_state_indices must be [N, S+1] with N={N}, got {tuple(spec_state_indices.shape)}")
    S1 = spec_state_indices.shape[1]
    if T != N * S1:
        _fail(f"speculative verify takes S+1 = {S1} tokens per sequence: {T} tokens for {N} sequences")
    if not (num_accepted_tokens is not None and num_accepted_tokens.shape == (N,)):
        _fail(f"speculative verify needs num_accepted_tokens [N] = [{N}]")
    if conv_rows < conv_width - 1 + S1 - 1:
        _fail(f"a conv state of {conv_rows} rows cannot hold W-1+S = {conv_width - 1 + S1 - 1} rows for S = {S1 - 1} drafts")
    # After a step that accepted 1 token the window starts at history row 0, so the S+1 new rows
    # must refill the whole state; fewer would leave rows a kernel reads from outside the slot.
    if conv_rows > conv_width - 1 + S1:
        _fail(
            f"a conv state of {conv_rows} rows (a pool sized for S = {conv_rows - (conv_width - 1)} drafts) needs "
            f"S+1 = {conv_rows - (conv_width - 1) + 1} tokens per sequence in a speculative step, got S+1 = {S1}"
        )
    return N, S1


def check_prefill_step(inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs,
                       out: torch.Tensor) -> tuple[int, int, int, int]:
    """Every check of a prefill entry point; returns (T, H, D, N)."""
    T, H, D = check_common(*inputs, weights, cache.conv_state, cache.recurrent_state, out, cache.conv_layout)
    return T, H, D, check_prefill(T, *seqs)


def check_decode_step(inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs,
                      out: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Every check of a decode entry point; returns (T, H, D, N, tokens per sequence)."""
    T, H, D = check_common(*inputs, weights, cache.conv_state, cache.recurrent_state, out, cache.conv_layout)
    rows = conv_state_rows(cache.conv_state, cache.conv_layout).shape[1]
    N, m = check_decode(T, *seqs, rows, weights.conv_width)
    return T, H, D, N, m
