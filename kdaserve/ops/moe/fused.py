"""The fused MoE path: two grouped GEMMs over the step's slots sorted by expert (align.py).

    gate_up: h[s]   = silu(x[s // k] W1[e]^T) * (x[s // k] W3[e]^T)       one program per
             (block of block_m sorted slots of expert e, block of the intermediate width),
             column blocks fastest in a 1-D grid
    down:    y[s]   = w[s] * h[s] W2[e]^T                                  same, over hidden
    out[t]  = sum_j y[t*k + j] (+ addend[t])                               in fp32, one pass

Each expert's weights are read once per block of its tokens, and the gate and up halves of one
intermediate column block are computed by the same program (the SiLU product is its epilogue).
The final sum reads each token's k rows in choice order: no atomics, so results do not depend on
timing. It also adds the shared experts' output where the layer has one (`addend`): one rounding,
and one launch less per MoE layer than adding it after. Expert weights come in bf16 / fp16 / fp32,
block-scaled FP8 (the activations quantized per token group) or 4 bits (MXFP4 / NVFP4, decoded in
registers before each dot: ops/fp4/tiles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.activation.swiglu import silu_product
from kdaserve.ops.compile_ahead import compiles_ahead
from kdaserve.ops.fp4.tiles import (
    decode_fp4_tile,
    decoded_dot,
    fp4_codes,
    fp4_packed,
    fp4_scale_pair,
    fp4_weight_tile,
    fp4_weights_left,
    k_step_offsets,
    mxfp4_scaled_dot,
    scale_pair_pipelines,
)
from kdaserve.ops.fp4.weights import Fp4Weights
from kdaserve.ops.fp4.word_decode import nvfp4_words_restored, words_decode, words_wide
from kdaserve.ops.fp8.quant import quantize_per_token_group
from kdaserve.ops.fp8.reference import FP8
from kdaserve.ops.moe.align import align_to_experts
from kdaserve.ops.precision import WIDE_SHARED_MEMORY_TARGETS, device_target, dot_precision, native_fp4_dots


@triton.jit
def _block_of_program(n_blocks):
    """(row block, column block) of this program in a 1-D grid, column blocks fastest: the programs
    in flight share their rows (gathered activations, read from DRAM once instead of once per
    column block) and an expert's weights (its few row blocks run side by side)."""
    pid = tl.program_id(0)
    return pid // n_blocks, pid % n_blocks


@triton.jit
def _expert_weights(w_ptr, shared_w_ptr, e, stride_we, num_routed, HAS_SHARED: tl.constexpr):
    """Expert e's weight in the stacked tensor, or with HAS_SHARED the shared expert's own tensor
    for e == num_routed (the shared expert run as one more expert)."""
    w_base = w_ptr + e.to(tl.int64) * stride_we
    if HAS_SHARED:
        if e == num_routed:
            w_base = shared_w_ptr
    return w_base


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, sorted_ptr, experts_ptr, h_ptr, xs_ptr, ws_ptr, shared_w_ptr, wd_ptr, shared_ws_ptr, shared_wd_ptr,
    S, HIDDEN, INTER, stride_x, stride_we, stride_wn, stride_h, stride_xs, stride_wse, stride_wsn, stride_wde, num_routed,
    TOPK: tl.constexpr, LIMIT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    FP8: tl.constexpr, BLOCK_ROWS: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr = False,
    W4: tl.constexpr = 0, W4_DOT: tl.constexpr = False, A_FORMAT: tl.constexpr = "bf16", W4_PAIR: tl.constexpr = False,
    W4_WORDS: tl.constexpr = False, W4_LEFT: tl.constexpr = False, W4_WIDE: tl.constexpr = False,
):
    """HAS_SHARED: expert `num_routed` is the shared expert, its [2I, hidden] weight at
    shared_w_ptr with w13's row stride (4-bit: its scales and divisors at shared_ws_ptr and
    shared_wd_ptr, with the routed ones' strides). W4 (4-bit experts, ops/fp4/tiles.py): the values per
    scale (32 MXFP4, 16 NVFP4); w_ptr holds packed bytes [E, 2I, hidden/2], ws_ptr the uint8 group
    scales [E, 2I, hidden/W4], wd_ptr (NVFP4) the fp32 divisors [E, 2I]. W4_DOT (MXFP4, x in
    A_FORMAT bf16 / fp16): the weights enter tl.dot_scaled as stored instead of decoded. W4_PAIR:
    the decoded path loads gate's and up's scales as one tile (ops/fp4/tiles.scale_pair_pipelines).
    W4_LEFT: the decoded tiles are the dots' left operands (acc^T = W x^T, K in fragment order:
    ops/fp4/tiles.in_fragment_order; moe_experts_fused says where). Fragment order loads the
    activations 4 bytes at a time, where a row mask costs three instructions a load: those loads
    are unmasked, a slot past the block's reading the block's first slot's row (its results are
    never stored; the first slot's row, not a fixed one, so that blocks do not all read one row).
    W4_WORDS: the codes load as 32-bit words, decoded by ops/fp4/word_decode.py's program (W4_WIDE:
    its program for MXFP4 scale codes past 128); NVFP4's accumulators then take back 2^16."""
    pid_m, pid_n = _block_of_program(tl.cdiv(INTER, BN))
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    w_base = _expert_weights(w_ptr, shared_w_ptr, e, stride_we, num_routed, HAS_SHARED)
    slots = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slots < S
    # A slot past the block's reads the block's first slot's row (always a slot of the expert): see W4_LEFT's load
    tokens = tl.where(valid, slots // TOPK, tl.load(sorted_ptr + pid_m * BM) // TOPK).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < INTER
    if FP8:   # block scales: one per (token, K block) for x, per (row block, K block) for W
        gate_scales = ws_ptr + e.to(tl.int64) * stride_wse + (cols // BLOCK_ROWS) * stride_wsn
        up_scales = ws_ptr + e.to(tl.int64) * stride_wse + ((cols + INTER) // BLOCK_ROWS) * stride_wsn
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    if W4:
        s_base = _expert_weights(ws_ptr, shared_ws_ptr, e, stride_wse, num_routed, HAS_SHARED)
        gate_w, gate_s = w_base + cols[:, None] * stride_wn, s_base + cols[:, None] * stride_wsn
        up_w, up_s = w_base + (cols + INTER)[:, None] * stride_wn, s_base + (cols + INTER)[:, None] * stride_wsn
        if W4_LEFT:
            acc_g = tl.zeros([BN, BM], tl.float32)
            acc_u = tl.zeros([BN, BM], tl.float32)
        # At least one K step (the wrapper checks): without it a zero-trip path zeroes the accumulators
        # between the wgmmas and their wait, and ptxas serializes every wgmma (warning C7515).
        tl.assume(HIDDEN > 0)
        for k0 in range(0, HIDDEN, BK):
            ks = k0 + k_step_offsets(BK, W4_LEFT)
            a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :],
                        mask=(valid[:, None] | W4_LEFT) & ((ks < HIDDEN) | EVEN_K)[None, :], other=0.0)
            if W4_DOT:
                acc_g = mxfp4_scaled_dot(a, gate_w, gate_s, col_ok[:, None], k0, HIDDEN, acc_g, BK, EVEN_K, A_FORMAT)
                acc_u = mxfp4_scaled_dot(a, up_w, up_s, col_ok[:, None], k0, HIDDEN, acc_u, BK, EVEN_K, A_FORMAT)
            else:
                if W4_PAIR:   # gate's and up's scales in one load (why: ops/fp4/tiles.fp4_scale_pair)
                    sg, su = fp4_scale_pair(s_base, cols, INTER, stride_wsn, col_ok, k0, HIDDEN, BK, W4, EVEN_K)
                    pg = fp4_packed(gate_w, col_ok[:, None], k0, HIDDEN, BK, EVEN_K, W4_WORDS)
                    pu = fp4_packed(up_w, col_ok[:, None], k0, HIDDEN, BK, EVEN_K, W4_WORDS)
                else:
                    pg, sg = fp4_codes(gate_w, gate_s, col_ok[:, None], k0, HIDDEN, BK, W4, EVEN_K, W4_WORDS)
                    pu, su = fp4_codes(up_w, up_s, col_ok[:, None], k0, HIDDEN, BK, W4, EVEN_K, W4_WORDS)
                acc_g = decoded_dot(a, decode_fp4_tile(pg, sg, BK, W4, a.dtype, W4_WORDS, W4_WIDE), acc_g, W4_LEFT, PREC)
                acc_u = decoded_dot(a, decode_fp4_tile(pu, su, BK, W4, a.dtype, W4_WORDS, W4_WIDE), acc_u, W4_LEFT, PREC)
        if W4_LEFT:
            acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
        if W4 == 16:   # NVFP4's global scale divides, per output row
            divisors = _expert_weights(wd_ptr, shared_wd_ptr, e, stride_wde, num_routed, HAS_SHARED) + cols
            if W4_WORDS:
                acc_g, acc_u = nvfp4_words_restored(acc_g), nvfp4_words_restored(acc_u)
            acc_g = acc_g / tl.load(divisors, mask=col_ok, other=1.0)[None, :]
            acc_u = acc_u / tl.load(divisors + INTER, mask=col_ok, other=1.0)[None, :]
    else:
        for k0 in range(0, HIDDEN, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = (ks < HIDDEN) | EVEN_K   # no K mask where BK divides K: a mask on K stops Triton's load pipelining
            a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(w_base + (cols + INTER)[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                         other=0.0)
            if FP8:
                kb = k0 // BK
                sa = tl.load(xs_ptr + tokens * stride_xs + kb, mask=valid, other=0.0)[:, None]
                acc_g += tl.dot(a, wg) * sa * tl.load(gate_scales + kb, mask=col_ok, other=0.0)[None, :]
                acc_u += tl.dot(a, wu) * sa * tl.load(up_scales + kb, mask=col_ok, other=0.0)[None, :]
            else:
                acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
                acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    h = silu_product(acc_g, acc_u, LIMIT, HAS_LIMIT)
    out = h_ptr + slots.to(tl.int64)[:, None] * stride_h + cols[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, sorted_ptr, experts_ptr, weights_ptr, y_ptr, hs_ptr, ws_ptr, shared_w_ptr, wd_ptr, shared_ws_ptr,
    shared_wd_ptr,
    S, HIDDEN, INTER, stride_h, stride_we, stride_wn, stride_y, stride_hs, stride_wse, stride_wsn, stride_wde, num_routed,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    FP8: tl.constexpr, BLOCK_ROWS: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr = False,
    W4: tl.constexpr = 0, W4_DOT: tl.constexpr = False, A_FORMAT: tl.constexpr = "bf16", W4_WORDS: tl.constexpr = False,
    W4_LEFT: tl.constexpr = False, W4_WIDE: tl.constexpr = False,
):
    """HAS_SHARED: expert `num_routed` is the shared expert, its [hidden, I] weight at
    shared_w_ptr with w2's row stride (4-bit: as in _moe_gate_up_kernel). W4, W4_DOT, W4_LEFT, W4_WORDS, W4_WIDE: 4-bit
    experts as in _moe_gate_up_kernel (packed [E, hidden, I/2], scales [E, hidden, I/W4], divisors
    [E, hidden])."""
    pid_m, pid_n = _block_of_program(tl.cdiv(HIDDEN, BN))
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    w_base = _expert_weights(w_ptr, shared_w_ptr, e, stride_we, num_routed, HAS_SHARED)
    slots = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slots < S
    rows = tl.where(valid, slots, tl.load(sorted_ptr + pid_m * BM)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < HIDDEN
    if FP8:
        w_scales = ws_ptr + e.to(tl.int64) * stride_wse + (cols // BLOCK_ROWS) * stride_wsn
    acc = tl.zeros([BM, BN], tl.float32)
    if W4:
        w_rows = w_base + cols[:, None] * stride_wn
        s_base = _expert_weights(ws_ptr, shared_ws_ptr, e, stride_wse, num_routed, HAS_SHARED)
        s_rows = s_base + cols[:, None] * stride_wsn
        if W4_LEFT:
            acc = tl.zeros([BN, BM], tl.float32)
        tl.assume(INTER > 0)   # one K step at least: as in _moe_gate_up_kernel
        for k0 in range(0, INTER, BK):
            ks = k0 + k_step_offsets(BK, W4_LEFT)
            a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :],
                        mask=(valid[:, None] | W4_LEFT) & ((ks < INTER) | EVEN_K)[None, :], other=0.0)
            if W4_DOT:
                acc = mxfp4_scaled_dot(a, w_rows, s_rows, col_ok[:, None], k0, INTER, acc, BK, EVEN_K, A_FORMAT)
            else:
                w = fp4_weight_tile(w_rows, s_rows, col_ok[:, None], k0, INTER, BK, W4, EVEN_K, a.dtype, W4_WORDS, W4_WIDE)
                acc = decoded_dot(a, w, acc, W4_LEFT, PREC)
        if W4_LEFT:
            acc = tl.trans(acc)
        if W4 == 16:
            divisors = _expert_weights(wd_ptr, shared_wd_ptr, e, stride_wde, num_routed, HAS_SHARED) + cols
            if W4_WORDS:
                acc = nvfp4_words_restored(acc)
            acc = acc / tl.load(divisors, mask=col_ok, other=1.0)[None, :]
    else:
        for k0 in range(0, INTER, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = (ks < INTER) | EVEN_K
            a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if FP8:
                kb = k0 // BK
                acc += (tl.dot(a, w) * tl.load(hs_ptr + rows * stride_hs + kb, mask=valid, other=0.0)[:, None]
                        * tl.load(w_scales + kb, mask=col_ok, other=0.0)[None, :])
            else:
                acc = tl.dot(a, w, acc, input_precision=PREC)
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, add_ptr, T, HIDDEN, stride_y, stride_out, stride_add,
                    TOPK: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, HAS_ADD: tl.constexpr = False):
    """out[t] = sum_j y[t*k + j] (+ add[t]) in fp32, in choice order, rounded once to out's dtype:
    one pass instead of torch's fp32 sum, its cast and the shared experts' add (three kernels)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = t < T
    mask = t_ok[:, None] & (cols < HIDDEN)[None, :]
    acc = tl.zeros([BT, BH], tl.float32)
    for j in tl.static_range(TOPK):
        slot = t.to(tl.int64) * TOPK + j
        acc += tl.load(y_ptr + slot[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + t.to(tl.int64)[:, None] * stride_add + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def moe_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per program: small when each expert gets few tokens (decode), where padding to a
    large block would multiply the work, large when experts get many (prefill)."""
    per_expert = num_slots / max(1, min(num_slots, num_experts))
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def fp8_tiles(block_m: int) -> tuple[int, int]:
    """(BN, warps) of both FP8 expert kernels. A program holds its fp32 accumulators and the scaled
    dot results beside them (gate|up: four [BM, BN] tiles): past BM = 16, BN = 64 spills on sm_89
    and gfx950 (tools/compile_check); BN = 32 spills on no target."""
    return (64, 4) if block_m <= 16 else (32, 4)


@dataclass(frozen=True)
class MoeTiles:
    """One launch shape of the two expert GEMMs: rows per program (each expert's run of sorted
    slots is padded to a multiple of it) and, per kernel, (columns, K step, warps, stages; None =
    the backend's default) and a cap on its registers a thread (NVIDIA's maxnreg; None: ptxas's
    choice), where one more program an SM pays more than the registers it takes away."""
    block_m: int
    gate_up: tuple[int, int, int, int | None]
    down: tuple[int, int, int, int | None]
    gate_up_regs: int | None = None
    down_regs: int | None = None


def moe_tiles(num_slots: int, num_experts: int, hidden: int, inter: int, fp8: bool, target: str,
              fp8_k: int = 128, four_bit: bool = False, fp4_left: bool | None = None) -> MoeTiles:
    """The launch shape the fused path takes for a step of `num_slots` (token, expert) pairs on
    `target` (ops/precision.device_target), the fastest of bench_moe_mla.py --sweep-moe on an H200
    (docs/perf-notes.md): steps of up to 48 slots per expert (decode) step K by 128; larger steps
    (prefill) take 128 rows per program, gate|up tiles of 2 x 128 columns and down tiles of 256 in
    8 warps and 4 stages. These need Hopper-class shared memory; elsewhere 64 x 64 tiles in the
    backend's default stages, which fit every target. 4-bit experts (`four_bit`) decode their
    weight tiles in registers: decode's down K steps of 256 (where they divide I); prefill's gate|up
    tiles narrower (2 x 64 columns; down 128; K steps of 64, 3 stages; sm_100's down K 128:
    bench_moe_mla.py --sweep-moe-fp4), which spill on no target (tools/compile_check); K steps of
    at least 32. Where the decoded 4-bit tiles go left of the dots (`fp4_left`, by default
    ops/fp4/tiles.fp4_weights_left: Hopper's decode) in row blocks of 16, down takes 128 columns in
    K steps of 128 (two wgmma row tiles a program, half the programs) and gate|up K steps of 256 where
    they divide hidden (bench_moe_mla.py --sweep-moe-fp4 on an H100: docs/perf-notes.md, forty-first
    session); at 32 rows that gate|up would take 255 registers (untimed: the shapes before stay)."""
    bm = moe_block_m(num_slots, num_experts)
    if fp8:
        bn, warps = fp8_tiles(bm)
        return MoeTiles(bm, (bn, fp8_k, warps, None), (bn, fp8_k, 4, None))
    if target not in WIDE_SHARED_MEMORY_TARGETS:
        return MoeTiles(bm, (_block(inter, 64), _block(hidden, 64), 4, None), (_block(hidden, 64), _block(inter, 64), 4, None))
    if four_bit and bm <= 16 and (fp4_weights_left(target, bm) if fp4_left is None else fp4_left):
        gate_up_k = 256 if hidden % 256 == 0 else 128
        return MoeTiles(bm, (_block(inter, 64), _block(hidden, gate_up_k), 4, 3), (_block(hidden, 128), _block(inter, 128), 4, 3))
    if bm < 64:   # 4-bit down in K steps of 256 where they divide I (a K mask stops load pipelining): sm_100's
        # NVFP4 down spills 4 bytes at 128; an H100 times both alike
        down_k = 256 if four_bit and inter % 256 == 0 else 128
        return MoeTiles(bm, (_block(inter, 64), _block(hidden, 128), 4, 3), (_block(hidden, 64), _block(inter, down_k), 4, 3))
    if four_bit:   # sm_100's NVFP4 down tile spills 8 bytes at K 64 (any stages): K 128 there
        down_k = 128 if target == "sm_100" else 64
        return MoeTiles(128, (_block(inter, 64), max(32, _block(hidden, 64)), 8, 3),
                        (_block(hidden, 128), max(32, _block(inter, down_k)), 8, 3))
    return MoeTiles(128, (_block(inter, 128), _block(hidden, 64), 8, 4), (_block(hidden, 256), _block(inter, 64), 8, 4))


@compiles_ahead   # at warm-up: align, gate-up, down and sum kernels compile in parallel (ops/compile_ahead.py)
def moe_experts_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, activation_limit: float | None = None, *,
                      w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                      block: tuple[int, int] | None = None, tiles: MoeTiles | None = None,
                      addend: torch.Tensor | None = None,
                      shared: tuple[torch.Tensor, torch.Tensor] | None = None, skip_expert: bool = False,
                      fp4_dots: bool | None = None, fp4_left: bool | None = None,
                      fp4_words: bool | None = None) -> torch.Tensor:
    """Same contract as ops/moe/reference.moe_experts_reference: x [T, hidden] -> [T, hidden];
    `addend` [T, hidden] (the shared experts' output) is added before the result's one rounding.
    `shared` = (w13 [2I, hidden], w2 [hidden, I]) of a shared expert of the routed experts' width,
    run as expert E (the ids' extra column, router_kernel's extra_expert): its GEMMs in the same
    launches as the routed experts' (bf16 / fp16 / fp32 weights, pointer loads; with 4-bit routed
    experts, a shared expert in their form and row strides).
    FP8 experts (w13, w2 in float8_e4m3fn with their block scales [E, rows / br, cols / bc]) take
    x and the SiLU product quantized per token and group of bc columns (ops/fp8); the definition
    is ops/moe/reference.moe_experts_fp8_reference. `tiles`: a launch shape other than
    moe_tiles' (benchmarks; an FP8 K step must equal the scale block's columns).
    4-bit experts (w13, w2 as ops/fp4/weights.Fp4Weights, MXFP4 or NVFP4) are decoded in registers
    inside both GEMMs, x and the SiLU product in their own dtype (W4A16); the definition is
    ops/moe/reference.moe_experts_reference over the dequantized weights. MXFP4 experts with bf16 /
    fp16 x go through `tl.dot_scaled` instead where the target multiplies fp4 natively
    (ops/precision.native_fp4_dots; `fp4_dots` True / False forces either, for tests). Decoded 4-bit
    tiles enter the dots as their left operands where ops/fp4/tiles.fp4_weights_left says, decoded
    there by the words program (ops/fp4/word_decode.py) on NVIDIA GPUs with bf16 x; `fp4_left` and
    `fp4_words` force either choice (tests, benchmarks; words need an NVIDIA GPU, bf16 x and codes
    in whole 32-bit words: word_decode.words_decode).
    `skip_expert`: id E marks choices computed elsewhere (another rank's experts under expert
    parallelism): aligned as one more expert whose blocks no program runs, their rows zero."""
    T, hidden, E, inter = check_expert_shapes("fused MoE", x, w13, w2, weights, ids, addend)
    w4 = isinstance(w13, Fp4Weights)
    fp8 = not w4 and w13.dtype == FP8
    if fp8:
        _check_fp8_experts(w13, w2, w13_scale, w2_scale, block, x.device)
    if w4:
        _check_fp4_experts(w13, w2, shared)
    elif shared is not None:
        _check_shared_expert(shared, w13, w2, fp8)
    if shared is not None:
        if skip_expert:
            raise ValueError("a shared expert run as expert E and skipped choices (id E, expert parallelism) exclude each "
                             "other: pass the shared expert's output as `addend` instead")
    interpreter_compat.install()
    k = ids.shape[1]
    S = T * k
    out_dtype = x.dtype
    x = x if x.stride(1) == 1 else x.contiguous()
    if w4:
        w13, w2 = w13.dense_rows(), w2.dense_rows()
        shared = None if shared is None else (shared[0].dense_rows(), shared[1].dense_rows())
    else:
        w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
        w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    if S == 0:
        return torch.zeros_like(x) if addend is None else addend.to(out_dtype, copy=True)
    E_all = E + (shared is not None)   # the shared expert is one more for the alignment and the tiles
    target = device_target(x.device)
    half_x = x.dtype in (torch.bfloat16, torch.float16)
    w4_dot = w4 and w13.group == 32 and half_x and (native_fp4_dots(target) if fp4_dots is None else fp4_dots)
    decoded = w4 and not w4_dot
    decoded_half = decoded and half_x   # 4-bit tiles decoded beside bf16 / fp16 x: either side of the dots
    t = tiles or moe_tiles(S, E_all, hidden, inter, fp8, target, block[1] if fp8 else 128, w4,
                           fp4_left=fp4_left if decoded_half else False)
    BM, (BN1, BK1, warps1, stages1), (BN2, BK2, warps2, stages2) = t.block_m, t.gate_up, t.down
    if fp8 and (BK1, BK2) != (block[1], block[1]):
        raise ValueError(f"FP8 experts step K by the scale block's {block[1]} columns; tiles asked {BK1} and {BK2}")
    if w4:   # a K step holds whole scale groups (ops/fp4/tiles.fp4_weight_tile): at least 32
        BK1, BK2 = max(BK1, 32), max(BK2, 32)
    sorted_slots, block_experts = align_to_experts(ids, E, BM, extra_expert=shared is not None or skip_expert)
    if skip_expert:   # the skipped expert's blocks: no program runs them (a kernel returns for e < 0)
        block_experts = torch.where(block_experts == E, -1, block_experts)
    m_blocks = block_experts.numel()
    prec = "ieee" if x.dtype == torch.float32 else dot_precision(x.device).tensor_core
    h = torch.empty(S, inter, dtype=x.dtype, device=x.device)
    # Arguments a kind of expert does not use get any tensor (their kernel branches are compiled out).
    shared_w13, shared_w2 = shared if shared is not None else (h, h)
    wd13 = wd2 = shared_ws13 = shared_ws2 = shared_wd13 = shared_wd2 = h
    group = 0   # W4: values per 4-bit scale
    if fp8:
        a, a_scale = quantize_per_token_group(x, block[1])
        ws13, ws2, br = w13_scale, w2_scale, block[0]
    elif w4:
        a, a_scale, ws13, ws2, br, group = x, h, w13.scale, w2.scale, 1, w13.group
        if w13.divisor is not None:
            wd13, wd2 = w13.divisor, w2.divisor
        w13, w2 = w13.packed, w2.packed
        if shared is not None:   # a 4-bit shared expert: its packed codes, scales and divisors apart
            s13, s2 = shared
            shared_w13, shared_w2, shared_ws13, shared_ws2 = s13.packed, s2.packed, s13.scale, s2.scale
            if s13.divisor is not None:
                shared_wd13, shared_wd2 = s13.divisor, s2.divisor
    else:
        a, a_scale, ws13, ws2, br = x, h, h, h, 1
    scaled = fp8 or w4
    left = decoded_half and (fp4_weights_left(target, BM) if fp4_left is None else fp4_left)
    words = decoded and words_decode(x, left, fp4_words, w13, w2, *(() if shared is None else (shared_w13, shared_w2)))
    dots = dict(W4_DOT=w4_dot, A_FORMAT="bf16" if x.dtype == torch.bfloat16 else "fp16", W4_LEFT=left, W4_WORDS=words)
    _moe_gate_up_kernel[(m_blocks * triton.cdiv(inter, BN1),)](
        a, w13, sorted_slots, block_experts, h, a_scale, ws13, shared_w13, wd13, shared_ws13, shared_wd13,
        S, hidden, inter, a.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        a_scale.stride(0), ws13.stride(0) if scaled else 0, ws13.stride(1) if scaled else 0, wd13.stride(0), E,
        TOPK=k, LIMIT=float(activation_limit or 0.0), HAS_LIMIT=activation_limit is not None,
        BM=BM, BN=BN1, BK=BK1, PREC=prec, FP8=fp8, BLOCK_ROWS=br, EVEN_K=hidden % BK1 == 0,
        HAS_SHARED=shared is not None, W4=group, **dots,
        W4_WIDE=words_wide(words, group, ws13, *([shared_ws13] if shared else [])),
        W4_PAIR=decoded and scale_pair_pipelines(BN1, BK1, group, warps1),
        num_warps=warps1, num_stages=stages1, **_register_cap(t.gate_up_regs),
    )
    hq, h_scale = quantize_per_token_group(h, block[1]) if fp8 else (h, h)
    # Skipped choices' rows stay zero for the final sum (their weight is zero, their rows unwritten).
    y = (torch.zeros if skip_expert else torch.empty)(S, hidden, dtype=torch.float32 if x.dtype == torch.float32
                                                      else x.dtype, device=x.device)
    _moe_down_kernel[(m_blocks * triton.cdiv(hidden, BN2),)](
        hq, w2, sorted_slots, block_experts, weights.reshape(-1).float().contiguous(), y, h_scale, ws2, shared_w2, wd2,
        shared_ws2, shared_wd2, S, hidden, inter, hq.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        h_scale.stride(0), ws2.stride(0) if scaled else 0, ws2.stride(1) if scaled else 0, wd2.stride(0), E,
        BM=BM, BN=BN2, BK=BK2, PREC=prec, FP8=fp8, BLOCK_ROWS=br, EVEN_K=inter % BK2 == 0,
        HAS_SHARED=shared is not None, W4=group, **dots,
        W4_WIDE=words_wide(words, group, ws2, *([shared_ws2] if shared else [])),
        num_warps=warps2, num_stages=stages2,
        **_register_cap(t.down_regs),
    )
    return sum_over_choices(y, T, k, out_dtype, addend)


def _register_cap(regs: int | None) -> dict:
    """The launch option that caps a kernel's registers a thread, where a tile asks for one."""
    return {} if regs is None else {"maxnreg": regs}


def check_expert_shapes(kind: str, x, w13, w2, weights, ids, addend) -> tuple[int, int, int, int]:
    """x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], weights / ids [T, k], addend None or
    [T, hidden] -> (T, hidden, E, I), or a ValueError naming what differs."""
    T, hidden = x.shape
    E, two_inter, hidden_w = w13.shape
    inter = two_inter // 2
    if hidden_w != hidden or tuple(w2.shape) != (E, hidden, inter) or ids.shape != weights.shape:
        raise ValueError(f"{kind} needs x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I] and [T, k] weights/ids; "
                         f"got x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if addend is not None and addend.shape != (T, hidden):
        raise ValueError(f"the addend must be [T, hidden] = {[T, hidden]}, got {list(addend.shape)}")
    if hidden < 1 or inter < 1:   # the kernels' K loops run at least once (_moe_gate_up_kernel says why)
        raise ValueError(f"{kind} needs a hidden size and an expert width of at least 1, got {hidden} and {inter}")
    return T, hidden, E, inter


def sum_over_choices(y: torch.Tensor, T: int, k: int, out_dtype: torch.dtype, addend: torch.Tensor | None) -> torch.Tensor:
    """out [T, hidden] = sum over each token's k rows of y (+ addend), one launch (_moe_sum_kernel)."""
    hidden = y.shape[1]
    out = torch.empty(T, hidden, dtype=out_dtype, device=y.device)
    BH = _block(hidden, 256)
    add = y if addend is None else addend if addend.stride(1) == 1 else addend.contiguous()   # y: unused pointer
    _moe_sum_kernel[(triton.cdiv(T, 4), triton.cdiv(hidden, BH))](
        y, out, add, T, hidden, y.stride(0), out.stride(0), add.stride(0), TOPK=k, BT=4, BH=BH,
        HAS_ADD=addend is not None, num_warps=4)
    return out


def _check_shared_expert(shared, w13: torch.Tensor, w2: torch.Tensor, fp8: bool) -> None:
    """A shared expert run as one more expert: the routed experts' shapes, dtype and row strides
    (the kernels address it as they address an expert's slice)."""
    s13, s2 = shared
    ok = (not fp8 and s13.dtype == w13.dtype and s2.dtype == w2.dtype and tuple(s13.shape) == tuple(w13.shape[1:])
          and tuple(s2.shape) == tuple(w2.shape[1:]) and s13.stride() == w13.stride()[1:]
          and s2.stride() == w2.stride()[1:])
    if not ok:
        raise ValueError(f"a shared expert run with the routed ones needs their width, dtype and layout (w13 "
                         f"{list(w13.shape[1:])}, w2 {list(w2.shape[1:])}, {w13.dtype}, contiguous rows; FP8 experts keep "
                         f"it apart): got {list(s13.shape)} {s13.dtype} and {list(s2.shape)} {s2.dtype}")


def fp4_shared_expert_fits(shared, w13: Fp4Weights, w2: Fp4Weights) -> bool:
    """Whether `shared` (gate|up, down) can run as one more expert beside 4-bit routed experts w13,
    w2: their 4-bit form and width, and their row strides (the kernels address the shared expert's
    packed codes and scales with the routed experts' strides)."""
    return all(isinstance(s, Fp4Weights) and s.group == w.group and s.shape == w.shape[1:]
               and s.packed.stride(-2) == w.packed.stride(-2) and s.scale.stride(-2) == w.scale.stride(-2)
               for s, w in zip(shared, (w13, w2)))


def _check_fp4_experts(w13: Fp4Weights, w2, shared) -> None:
    if not isinstance(w2, Fp4Weights) or w2.group != w13.group:
        raise ValueError(f"4-bit experts need w13 and w2 in one 4-bit form ({w13.scheme}); got w2 as "
                         f"{w2.scheme if isinstance(w2, Fp4Weights) else w2.dtype}")
    if shared is not None and not fp4_shared_expert_fits(shared, w13, w2):
        raise ValueError(f"a shared expert run with 4-bit routed experts needs their form ({w13.scheme}), width and "
                         f"row strides (packed, scales 16 bytes apart as the layers store them: w13 "
                         f"{list(w13.shape[1:])}, w2 {list(w2.shape[1:])}); got "
                         + ", ".join(f"{s.scheme} {list(s.shape)}" if isinstance(s, Fp4Weights) else str(s.dtype)
                                     for s in shared))


def _check_fp8_experts(w13, w2, w13_scale, w2_scale, block, device) -> None:
    from kdaserve.ops.fp8.block_gemm import min_column_block

    E, two_inter, hidden = w13.shape
    if w2.dtype != FP8 or w13_scale is None or w2_scale is None or block is None:
        raise ValueError("FP8 experts need w13 and w2 in float8_e4m3fn with w13_scale, w2_scale and the block size")
    br, bc = block
    want13 = (E, triton.cdiv(two_inter, br), triton.cdiv(hidden, bc))
    want2 = (E, triton.cdiv(hidden, br), triton.cdiv(two_inter // 2, bc))
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(f"FP8 expert scales for {br} x {bc} blocks must be w13 {list(want13)} and w2 {list(want2)}; "
                         f"got {list(w13_scale.shape)} and {list(w2_scale.shape)}")
    if (two_inter // 2) % br:
        raise ValueError(f"FP8 experts need the expert width ({two_inter // 2}) to be a multiple of the block's "
                         f"{br} rows (the gate and up halves must not share a scale block)")
    if bc < min_column_block(device) or bc & (bc - 1):
        raise ValueError(f"the weight's column block (one K step) must be a power of two of at least "
                         f"{min_column_block(device)} on {device.type}, got {bc}")
