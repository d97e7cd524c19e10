"""4-bit weight tiles inside Triton GEMMs (W4A16): packed e2m1 bytes and their group scales turned
into the activations' dtype in registers, right before the tensor-core dot.

A K step of a weight's BN output rows arrives as [BN, BK/2] bytes, byte j of a row holding
elements 2j (low nibble) and 2j+1 (high nibble): the checkpoint's packing, kept as released. The
two nibble tiles are interleaved back into K order along the tile's last axis (`tl.interleave`,
within each thread's registers), each row's BK / GROUP scales are loaded once and broadcast over
their groups, and the decoded [BN, BK] tile enters the dot transposed (`fp4_weight_tile`), beside
activations loaded as the bf16 path loads them (contiguous rows).

Scales are never loaded per weight element and activations never with a stride: both cost more
than the 4-bit bytes save (benchmarks/bench_fp4_tiles.py times the alternatives; docs/perf-notes.md).

Every decoded value is exact in the activations' dtype: an e2m1 value (2 significant bits) times a
power of two (MXFP4's e8m0 scale) or an e4m3 value (4 significant bits) fits bf16's 8. NVFP4's
per-tensor global scale divides the accumulator once per output column after the K loop
(layers keep it per output row, so merged and sliced weights carry theirs).

bf16 activations (the serving dtype) take the decode straight into bf16 bit patterns
(`e2m1_bf16_pair`: a byte's two values as one 32-bit register's halves, five integer operations a
byte) and two packed bf16 products a pair; fp16 and fp32 activations take `e2m1_pair`'s fp32 pass
(about twice the instructions a value: benchmarks/bench_fp4_tiles.py, docs/perf-notes.md)."""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.fp4.word_decode import e2m1_words_bf16, mxfp4_scale_pair, nvfp4_scale_pair


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
def e2m1_bf16_pair(packed):
    """uint8 codes (two per byte) -> (low nibbles', high nibbles') values times 2^-126 in bf16,
    exactly: a code's magnitude bits placed at bf16's bits 6..8 (the exponent's two low bits and the
    mantissa's top bit; code 1, 0.5, becomes the subnormal 2^-127) and its sign at bit 15. One
    32-bit product copies the byte to bits 6 and 18, so a byte's two values come out as the two
    halves of one register, the pair a tensor-core operand holds (no per-value conversions)."""
    y = packed.to(tl.uint32) * 0x40040
    d = (y & 0x01C001C0) | ((y << 6) & 0x80008000)
    return d.to(tl.uint16).to(tl.bfloat16, bitcast=True), (d >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def group_scale_bf16(s, GROUP: tl.constexpr):
    """uint8 scale codes -> bf16 factors, exactly (group_scale's values; e8m0's 2^-127 is bf16's
    subnormal 0x0040, e4m3's 3 mantissa bits fit bf16's 7)."""
    if GROUP == 16:
        return group_scale(s, GROUP).to(tl.bfloat16)
    else:
        return tl.where(s == 0, 0x40, s.to(tl.uint16) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)


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
def fp4_packed(w_rows, row_ok, k0, K, BK: tl.constexpr, EVEN_K: tl.constexpr, WORDS: tl.constexpr = False):
    """One K step of BN weight rows' packed bytes: `w_rows` [BN, 1] pointers to the rows, `row_ok`
    [BN, 1] -> uint8 [BN, BK/2], or with WORDS uint32 [BN, BK/8] (4 bytes of a row a word, in the
    order stored: rows and their starts in whole words, as word_decode.words_fit checks). Rows and K
    steps past the weight (where BK does not divide K) read as zero codes."""
    if WORDS:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        words = w_rows.to(tl.pointer_type(tl.uint32))
        tile = tl.load(words + kw[None, :], mask=row_ok & ((kw < K // 8) | EVEN_K)[None, :], other=0)
    else:
        kq = k0 // 2 + tl.arange(0, BK // 2)
        tile = tl.load(w_rows + kq[None, :], mask=row_ok & ((kq < K // 2) | EVEN_K)[None, :], other=0)
    return tile


@triton.jit
def fp4_codes(w_rows, s_rows, row_ok, k0, K, BK: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
              WORDS: tl.constexpr = False):
    """One K step of BN weight rows as stored: fp4_packed's bytes (or WORDS), and from `s_rows` [BN, 1]
    (pointers to the rows' group scales) their scale codes [BN, BK/GROUP], uint8."""
    kg = k0 // GROUP + tl.arange(0, BK // GROUP)
    scales = tl.load(s_rows + kg[None, :], mask=row_ok & ((kg < K // GROUP) | EVEN_K)[None, :], other=0)
    return fp4_packed(w_rows, row_ok, k0, K, BK, EVEN_K, WORDS), scales


@triton.jit
def fp4_scale_pair(s_base, rows, offset, stride_row, row_ok, k0, K, BK: tl.constexpr, GROUP: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """One K step's scale codes of two sets of BN rows, `rows` and `rows + offset` (a gate|up weight's
    gate and up rows), `row_ok` [BN] -> two uint8 [BN, BK/GROUP], loaded as one [BN, 2, BK/GROUP] tile.

    Why one load: Triton pipelines a load through shared memory (and then reads it in the layout
    the dot needs) only where each thread's share is at least 4 bytes. MXFP4's K steps of 128 hold
    4 scales a row, 2 bytes a thread of a [64, 4] tile in 4 warps: loaded apart, each step would
    wait on a global load and send the scales through shared memory once more, with a barrier.
    Together the thread's share is 4 bytes (with scale rows 16-byte aligned: ops/fp4/weights.py).
    Where it changes nothing (`scale_pair_pipelines`), the rows' scales load apart (fp4_codes)."""
    kg = k0 // GROUP + tl.arange(0, BK // GROUP)
    pair = rows[:, None, None] + offset * tl.arange(0, 2)[None, :, None]
    both = tl.load(s_base + pair * stride_row + kg[None, None, :],
                   mask=row_ok[:, None, None] & ((kg < K // GROUP) | EVEN_K)[None, None, :], other=0)
    return tl.split(tl.permute(both, (0, 2, 1)))


def scale_pair_pipelines(bn: int, bk: int, group: int, warps: int) -> bool:
    """Whether a gate|up kernel of BN rows, K steps of BK and `warps` warps loads its two scale
    tiles as one (fp4_scale_pair): where a thread's share of one is under the 4 bytes a pipelined
    load needs, and of both together is not."""
    share = bn * (bk // group) / (32 * warps)
    return share < 4 <= 2 * share


@triton.jit
def fp4_weight_tile(w_rows, s_rows, row_ok, k0, K, BK: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                    dtype: tl.constexpr, WORDS: tl.constexpr = False, WIDE: tl.constexpr = False):
    """One K step of BN weight rows (fp4_codes' arguments), decoded: [BN, BK] in `dtype`, K order."""
    packed, codes = fp4_codes(w_rows, s_rows, row_ok, k0, K, BK, GROUP, EVEN_K, WORDS)
    return decode_fp4_tile(packed, codes, BK, GROUP, dtype, WORDS, WIDE)


@triton.jit
def decode_fp4_tile(packed, codes, BK: tl.constexpr, GROUP: tl.constexpr, dtype: tl.constexpr,
                    WORDS: tl.constexpr = False, WIDE: tl.constexpr = False):
    """Packed bytes [BN, BK/2] and their scale codes [BN, BK/GROUP] -> [BN, BK] in `dtype`, K order.
    WORDS (bf16 only, NVIDIA: ops/fp4/word_decode.py; its words_decode says where): by the words
    program, the scale inside; `packed` then holds words [BN, BK/8] (fp4_packed's WORDS), and NVFP4's
    values come out times 2^-16 (the kernels take it back: word_decode.nvfp4_words_restored). WIDE:
    MXFP4 scale codes past word_decode.MXFP4_FOLDED_MAX_CODE (or not known)."""
    tl.static_assert(dtype == tl.bfloat16 or not WORDS, "the words program decodes into bf16 only")
    if WORDS:
        pairs = mxfp4_scale_pair(codes, WIDE) if GROUP == 32 else nvfp4_scale_pair(codes)
        w = e2m1_words_bf16(packed, _per_value(pairs, BK // 8, GROUP // 8), GROUP == 32 and WIDE)
    elif dtype == tl.bfloat16:
        # Two bf16 products per value pair, each exact: by 2^126 (the bit placement's), then by the
        # scale. One product by the two factors' product would overflow for e8m0 codes above 128.
        lo, hi = e2m1_bf16_pair(packed)
        w = tl.interleave(lo, hi) * (2.0 ** 126) * _per_value(group_scale_bf16(codes, GROUP), BK, GROUP)
    else:
        lo, hi = e2m1_pair(packed)
        w = (tl.interleave(lo, hi) * _per_value(group_scale(codes, GROUP), BK, GROUP)).to(dtype)
    return w


@triton.jit
def _per_value(g, BK: tl.constexpr, GROUP: tl.constexpr):
    """[BN, BK / GROUP] group factors -> [BN, BK], each repeated over its group (in registers)."""
    return tl.reshape(tl.broadcast_to(g[:, :, None], (g.shape[0], BK // GROUP, GROUP)), (g.shape[0], BK))


# Where the decoded tiles go on the left of the dots at decode: Hopper, whose wgmma takes its left
# operand from registers (the weights as decoded, K in fragment order) and its right from shared memory
# (the activations). Elsewhere (mma.sync, tcgen05, MFMA) the left side is untimed.
FP4_LEFT_TARGETS = ("sm_90",)


def fp4_weights_left(target: str, block_m: int) -> bool:
    """Whether the 4-bit expert GEMMs on `target` put their decoded weight tiles on the left of the
    dots (acc^T = W x^T, K in fragment order) at `block_m` activation rows per program: on
    FP4_LEFT_TARGETS at decode's row blocks (under 64: ops/moe/fused.moe_tiles), with the words
    decoder (ops/fp4/word_decode.py). Prefill's K steps of 64 would give a thread 8 bytes a row and a
    longer loop, so prefill stays right; so does the 4-bit linear layer, where neither side won
    everywhere (timings and counts: docs/perf-notes.md, fortieth session)."""
    return target in FP4_LEFT_TARGETS and block_m < 64


@triton.jit
def fragment_order_k(BK: tl.constexpr):
    """The memory offsets, within a K step of BK, of the positions of `in_fragment_order`'s K order:
    position 2q + r (value r of pair q) holds memory position 2 (BK/8 (q % 4) + q // 4) + r. An
    operand beside a tile in fragment order loads its K positions from these offsets (runs of 2)."""
    p = tl.arange(0, BK)
    return 2 * ((BK // 8) * (p // 2 % 4) + p // 8) + p % 2


@triton.jit
def in_fragment_order(w):
    """[R, BK] decoded weight values, K in memory order -> the same values, K in fragment order.

    Why: a tensor-core operand held in registers (mma's and wgmma's left operand, 2 values a 32-bit
    register) gives each of the 4 threads along a row every 4th pair of K positions: of a row of
    4-bit bytes (a pair of values each), bytes t, t + 4, t + 8 ..., so each thread loads its bytes one
    at a time. Pair q of fragment order is memory pair BK/8 (q % 4) + q // 4: a thread's pairs are
    BK/8 bytes side by side, one vector load. A dot sums over K in any order both operands share, so
    the other operand loads its K positions from `fragment_order_k`. The reordering is of registers
    only: Triton lays the decoded tile out so that it moves no value."""
    R: tl.constexpr = w.shape[0]
    BK: tl.constexpr = w.shape[1]
    return tl.reshape(tl.permute(tl.reshape(w, (R, 4, BK // 8, 2)), (0, 2, 1, 3)), (R, BK))


@triton.jit
def k_step_offsets(BK: tl.constexpr, LEFT: tl.constexpr):
    """The K offsets a K step's activations load from: memory order, or with LEFT fragment order."""
    if LEFT:
        offsets = fragment_order_k(BK)
    else:
        offsets = tl.arange(0, BK)
    return offsets


@triton.jit
def decoded_dot(a, w, acc, LEFT: tl.constexpr, PREC: tl.constexpr):
    """One K step of a 4-bit GEMM: activations a [BM, BK] (from k_step_offsets) and a decoded weight
    tile w [BN, BK] (memory order) into acc [BM, BN] (acc + a w^T), or with LEFT into acc^T [BN, BM]
    (acc^T + W a^T, the tile the dot's left operand, K in fragment order on both sides)."""
    if LEFT:
        acc = tl.dot(in_fragment_order(w), tl.trans(a), acc, input_precision=PREC)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def mxfp4_scaled_dot(a, w_rows, s_rows, row_ok, k0, K, acc, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     A_FORMAT: tl.constexpr):
    """acc + a @ W^T for one K step of BN MXFP4 weight rows through `tl.dot_scaled`: the packed
    bytes [BN, BK/2] and e8m0 scales [BN, BK/32] go to the tensor cores as stored, where the target
    multiplies fp4 itself (ops/precision.NATIVE_FP4_DOT_TARGETS). `a` [BM, BK] in bf16 or fp16
    (`A_FORMAT`); the weight's other arguments as fp4_codes'."""
    packed, scales = fp4_codes(w_rows, s_rows, row_ok, k0, K, BK, 32, EVEN_K)
    return tl.dot_scaled(a, None, A_FORMAT, tl.trans(packed), scales, "e2m1", acc)
