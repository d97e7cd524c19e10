"""4-bit weight tiles inside Triton GEMMs (W4A16): packed e2m1 bytes and their group scales turned
into the activations' dtype in registers, right before the tensor-core dot.

A [BK, BN] weight tile of K rows arrives as [BK/2, BN] bytes, byte row i holding elements 2i (low
nibble) and 2i+1 (high nibble) of the K step (the checkpoint's packing, kept as released). Rather
than interleaving the two nibble tiles back into K order, a program splits the activations
instead: the even K columns multiply the low nibbles, the odd ones the high nibbles, two dots of
BK/2 each into the same accumulator. The activations are the small operand at decode, and nothing
is reordered in registers.

Every decoded value is exact in the activations' dtype: an e2m1 value (2 significant bits) times a
power of two (MXFP4's e8m0 scale) or an e4m3 value (4 significant bits) fits bf16's 8. NVFP4's
per-tensor global scale divides the accumulator once per output column after the K loop
(layers keep it per output row, so merged and sliced weights carry theirs)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_pair(packed):
    """uint8 codes (two per byte) -> (low nibbles' values, high nibbles' values) in fp32, exactly:
    an e2m1 code's bits placed in an fp16 (magnitude bits at 9..11, sign at 15) make the value
    times 2^-14, subnormals included (0.5 is fp16's 2^-15)."""
    p = packed.to(tl.uint16)
    lo = ((p & 7) << 9) | ((p & 8) << 12)
    hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    return (lo.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0,
            hi.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0)


@triton.jit
def group_scale(s, GROUP: tl.constexpr):
    """uint8 scale codes -> fp32 factors. NVFP4 (GROUP 16): e4m3 bits placed in an fp16 (exponent
    and mantissa shifted by 7) make the value times 2^-8. MXFP4 (GROUP 32): e8m0, 2^(s - 127), made
    from the exponent field (s = 0 is 2^-127, a subnormal: its own bits)."""
    if GROUP == 16:
        u = s.to(tl.uint16)
        h = ((u & 0x7F) << 7) | ((u & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        bits = tl.where(s == 0, 0x00400000, s.to(tl.int32) << 23)
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp4_activations(a_rows, row_ok, k0, K, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """The activations of one K step split for fp4_dot: `a_rows` [BM, 1] pointers to the rows' first
    element, `row_ok` [BM, 1] -> (even K columns, odd K columns) [BM, BK/2], the step's byte rows
    `kh` (elements 2 kh and 2 kh + 1) and which are inside K (every one where BK divides K: a mask
    on K stops Triton's load pipelining)."""
    kh = k0 // 2 + tl.arange(0, BK // 2)
    kh_ok = (kh < K // 2) | EVEN_K
    a_even = a_rows + 2 * kh[None, :]
    mask = row_ok & kh_ok[None, :]
    return tl.load(a_even, mask=mask, other=0.0), tl.load(a_even + 1, mask=mask, other=0.0), kh, kh_ok


@triton.jit
def fp4_dot(a_even, a_odd, w_cols, s_cols, kh, mask, acc, GROUP: tl.constexpr, PREC: tl.constexpr):
    """acc + a W for one K step: `w_cols` / `s_cols` [1, BN] pointers to the output columns' packed
    bytes and group scales, `kh` the step's byte rows (fp4_activations), `mask` [BK/2, BN],
    `a_even` / `a_odd` [BM, BK/2] the activations' even / odd K columns."""
    packed = tl.load(w_cols + kh[:, None], mask=mask, other=0)
    scale = group_scale(tl.load(s_cols + (2 * kh // GROUP)[:, None], mask=mask, other=0), GROUP)
    lo, hi = e2m1_pair(packed)
    acc = tl.dot(a_even, (lo * scale).to(a_even.dtype), acc, input_precision=PREC)
    return tl.dot(a_odd, (hi * scale).to(a_odd.dtype), acc, input_precision=PREC)


