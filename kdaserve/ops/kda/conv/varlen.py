"""Varlen (prefill) causal conv + SiLU over the merged q|k|v channels, conv-state pool in place.

Design (why):
- x is read where it lies: a column slice of the projection buffer (row stride arbitrary,
  columns contiguous) is passed by pointer and row stride, never copied.
- The output and the new states are two launches (see varlen_kernel.py): the state writer runs
  only after every output program has read the old history, so in-place update cannot race.
- The token-block table is built on the host from `cu_seqlens_cpu` (no device->host sync): one
  entry per block of BT tokens of one sequence, so a block never straddles two sequences and
  long and short sequences share the grid evenly. A caller that runs many layers on one step (the
  engine) builds it once with `conv_step_tables` and passes it to every layer.
- Math in fp32 (weights are fp32), y stored in `out`'s dtype (x.dtype by default). The new state
  rows are the pre-conv inputs cast once to the pool's dtype, exactly as the reference does, so
  conv states match the reference bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from kdaserve.ops.kda.checks import check_cu_seqlens_cpu
from kdaserve.ops.kda.conv.varlen_kernel import conv_varlen_out_kernel, conv_varlen_state_kernel
from kdaserve.ops.kda.host_tables import host_offsets, tables_to_device
from kdaserve.ops.kda.types import conv_state_rows

BLOCK_T = 16  # tokens per program: the fastest of the launch shapes timed (docs/perf-notes.md)
BLOCK_C = 128
NUM_WARPS = 4


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_conv_inputs(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None) -> None:
    """Metadata-only checks shared by the varlen and update entry points (no device sync). Each
    condition is tested before its message is formatted: these run once per layer per step."""
    C = x.shape[1] if x.dim() == 2 else -1
    if not (x.dim() == 2 and x.stride(1) == 1):
        raise ValueError(f"x must be [T, 3P] with contiguous columns, got shape {tuple(x.shape)} strides {x.stride()}")
    if not (weight.dim() == 2 and weight.shape[0] == C):
        raise ValueError(f"conv weight must be [3P, W] = [{C}, W], got {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"conv weight must have contiguous taps (stride(1) == 1), got strides {weight.stride()}")
    W = weight.shape[1]
    if not (rows.dim() == 3 and rows.shape[2] == C and rows.shape[1] >= W - 1):
        raise ValueError(f"conv_state must hold >= W-1 = {W - 1} rows of {C} channels per slot, got a [slots, rows, C] view of "
                         f"{tuple(rows.shape)}")
    if out is not None and not (out.dim() == 2 and out.shape == x.shape and out.stride(1) == 1):
        raise ValueError(f"out must be [T, 3P] = {tuple(x.shape)} with contiguous columns, got {tuple(out.shape)} strides "
                         f"{out.stride()}")
    if not (weight.device == x.device and rows.device == x.device):
        raise ValueError(f"conv tensors must share one device, got {sorted(map(str, {t.device for t in (x, weight, rows)}))}")


def token_block_values(offsets: tuple[int, ...], block_t: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence index, first token inside the sequence) of every BT-token block, int32 numpy arrays."""
    cu = np.array(offsets, dtype=np.int64)
    blocks = -(-(cu[1:] - cu[:-1]) // block_t)
    seq = np.repeat(np.arange(blocks.size), blocks)
    first = np.cumsum(blocks) - blocks
    t0 = (np.arange(seq.size) - first[seq]) * block_t
    return seq.astype(np.int32), t0.astype(np.int32)


def token_block_table(cu_seqlens_cpu: torch.Tensor, block_t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two tables as int32 host tensors."""
    seq, t0 = token_block_values(host_offsets(cu_seqlens_cpu), block_t)
    return torch.from_numpy(seq), torch.from_numpy(t0)


@dataclass(frozen=True, slots=True)
class ConvTables:
    """One step's token-block table on the device: block b covers tokens [block_t0[b], +BLOCK_T) of
    sequence block_seq[b]. `offsets` are the host cu_seqlens it was built from."""

    block_seq: torch.Tensor
    block_t0: torch.Tensor
    offsets: tuple[int, ...]


def conv_step_tables(offsets: tuple[int, ...], device: torch.device) -> ConvTables:
    """The table of a step with these host offsets (cu_seqlens values), in one host->device copy."""
    block_seq, block_t0 = tables_to_device(list(token_block_values(offsets, BLOCK_T)), device)
    return ConvTables(block_seq, block_t0, offsets)


def causal_conv_varlen_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    conv_layout: str = "SD",
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tables: ConvTables | None = None,
) -> torch.Tensor:
    """y = silu(causal conv(x)) for varlen sequences; new conv states written in place.

    x [T, 3P] (stride(1) == 1, any row stride); weight [3P, W] fp32; conv_state SD
    [slots, L, 3P] or DS [slots, 3P, L]. Sequences whose slot is <= 0 are skipped: their y rows
    are NOT written (contents unspecified) and no state is read or written. Pass `cu_seqlens_cpu`
    (host copy): without it the table is built from `cu_seqlens.cpu()`, a device->host sync that
    is fine for tests and tools, not for the serving hot path. `tables`: the step's
    `conv_step_tables`, built once for all layers; None builds them for this call.
    """
    rows = conv_state_rows(conv_state, conv_layout)
    check_conv_inputs(x, weight, rows, out)
    N = state_indices.shape[0]
    if cu_seqlens.shape != (N + 1,):
        raise ValueError(f"cu_seqlens must be [N+1] = [{N + 1}], got {tuple(cu_seqlens.shape)}")
    if has_initial_state.shape != (N,):
        raise ValueError(f"has_initial_state must be [N] = [{N}], got {tuple(has_initial_state.shape)}")
    T, C = x.shape
    offsets = check_cu_seqlens_cpu(cu_seqlens_cpu, N, T)
    if tables is not None and (len(tables.offsets) != N + 1 or tables.offsets[-1] != T
                               or (offsets is not None and offsets != tables.offsets)):
        raise ValueError(f"conv tables were built for a step of {len(tables.offsets) - 1} sequences and "
                         f"{tables.offsets[-1]} tokens (lengths {tables.offsets}), not this one ({N} and {T}"
                         f"{f', lengths {offsets}' if offsets is not None else ''}); build them for this step")
    L, W = rows.shape[1], weight.shape[1]
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0 or N == 0:
        return y
    if tables is None:
        if offsets is None:
            offsets = host_offsets(cu_seqlens.cpu())  # a device->host sync: only off the hot path
        tables = conv_step_tables(offsets, x.device)
    block_seq, block_t0 = tables.block_seq, tables.block_t0
    if block_seq.numel() == 0:
        return y
    s_slot, s_row, s_c = rows.stride()
    n_cblk = -(-C // BLOCK_C)  # triton.cdiv, without its constexpr-function wrapper (hot path)
    conv_varlen_out_kernel[(block_seq.numel(), n_cblk)](
        x, x.stride(0), weight, weight.stride(0),
        rows, s_slot, s_row, s_c,
        y, y.stride(0),
        cu_seqlens, state_indices, has_initial_state,
        block_seq, block_t0,
        C, L,
        W=W, BT=BLOCK_T, BC=BLOCK_C, num_warps=NUM_WARPS,
    )
    conv_varlen_state_kernel[(N, n_cblk)](
        x, x.stride(0),
        rows, s_slot, s_row, s_c,
        cu_seqlens, state_indices, has_initial_state,
        C, L,
        BL=triton.next_power_of_2(L), BC=BLOCK_C,
    )
    return y
