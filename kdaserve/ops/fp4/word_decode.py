"""e2m1 codes decoded a 32-bit word at a time by one inline-asm program that places each value's
bits where bf16 has them (PTX `prmt`, a shift and a mask a byte) and applies the group scale in one
bf16x2 product a value pair: the "words" decoder, which the 4-bit GEMMs take on NVIDIA GPUs with
bf16 activations where their decoded tiles are the dots' left operands (tiles.fp4_weights_left:
Hopper's decode); tiles.py's bitwise decoding everywhere else.

Why: a 32-bit word of codes arrives whole where the tiles are left of the dots (fragment order: a
thread's bytes side by side), and there the decode kernels come close to bound by instruction issue.
Per word the program spends one shift, per byte a `prmt`, a shift and an `and` whose constants are
all immediates (nothing for ptxas to hold or copy into registers), and per byte one product; tiles.py's
bitwise decoding spends two products a pair (counts, and the byte tables this replaced:
docs/perf-notes.md). The codes load as 32-bit words, not bytes: bytes reach the asm packed in the
register order of the wgmma operand, which alternates rows, and gathering them costs two more `prmt`
a word.

How (`_E2M1_WORD_PTX`; a word w holds elements 2k (low nibble) and 2k+1 (high) in byte k, a
nibble's bit 3 its sign): `prmt` picks from w and w << 4, for byte k, the register [byte k of
w << 4, that byte's top bit repeated, byte k of w, its top bit repeated]: the low nibble in bits
4..7, the high one in bits 20..23, each sign filling the byte above. Shifted left by 2 and masked by
0x81C081C0, each half holds its nibble's magnitude at bf16's bits 6..8 (the exponent's two low bits
and the mantissa's top bit) and its sign at bit 15: the value times 2^-126 exactly (code 1, 0.5,
becomes the subnormal 2^-127). One bf16x2 product by the scale factor, exact, makes the value:
- MXFP4 (e8m0 code s): the factor 2^(s - 1), bf16's exponent field s + 126, one integer multiply-add
  (mxfp4_scale_pair). It exists for codes up to 128 (scales up to 2: blocks whose largest magnitude
  is under 16). Weights whose scale codes go past that, or are not known (`largest_code`), take the
  `WIDE` program: the pair times 2^126 first, then the scale itself.
- NVFP4 (unsigned e4m3 value v): the factor v * 2^110 (nvfp4_scale_pair; v * 2^126 overflows bf16
  from v = 2), so the decoded values are the block-scaled ones times 2^-16 and the kernels multiply
  their accumulators by 2^16 (nvfp4_words_restored) before the global scale divides them: a power of
  two, exact, and fp32 accumulators stay far above their subnormals.
Products run as fmas adding -0 (sm_80 and sm_89 have no bf16x2 product).
The interpreter runs no inline asm: tests/ops/test_fp4.py executes these very programs in Python over
every byte in every position and every scale code, and on a GPU compares both decoders bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_E2M1_WORD_PTX_TEMPLATE = """{
.reg .b32 ws, r0, r1, r2, r3, nz;
mov.b32 nz, 0x80008000;
shl.b32 ws, $4, 4;
prmt.b32 r0, $4, ws, 0x80C4;
prmt.b32 r1, $4, ws, 0x91D5;
prmt.b32 r2, $4, ws, 0xA2E6;
prmt.b32 r3, $4, ws, 0xB3F7;
shl.b32 r0, r0, 2;
shl.b32 r1, r1, 2;
shl.b32 r2, r2, 2;
shl.b32 r3, r3, 2;
and.b32 r0, r0, 0x81C081C0;
and.b32 r1, r1, 0x81C081C0;
and.b32 r2, r2, 0x81C081C0;
and.b32 r3, r3, 0x81C081C0;
TIMES_2_TO_126fma.rn.bf16x2 $0, r0, $5, nz;
fma.rn.bf16x2 $1, r1, $5, nz;
fma.rn.bf16x2 $2, r2, $5, nz;
fma.rn.bf16x2 $3, r3, $5, nz;
}"""
# The WIDE program's first product: each pair times 2^126 (bf16 0x7E80), the exact e2m1 values.
_TIMES_2_TO_126 = """mov.b32 ws, 0x7E807E80;
fma.rn.bf16x2 r0, r0, ws, nz;
fma.rn.bf16x2 r1, r1, ws, nz;
fma.rn.bf16x2 r2, r2, ws, nz;
fma.rn.bf16x2 r3, r3, ws, nz;
"""
_E2M1_WORD_PTX = tl.constexpr(_E2M1_WORD_PTX_TEMPLATE.replace("TIMES_2_TO_126", ""))
_E2M1_WORD_PTX_WIDE = tl.constexpr(_E2M1_WORD_PTX_TEMPLATE.replace("TIMES_2_TO_126", _TIMES_2_TO_126))
# An unsigned e4m3 code -> its value v * 2^110 in both bf16 halves: the code times 0x00100010 is v * 2^-120
# (the code shifted by 4 is bf16's exponent field, 120 less than e4m3's bias, and mantissa, subnormals
# e4m3's on bf16's), then times 2^127 (0x7F00) and 2^103 (0x7300), each exact.
_NVFP4_SCALE_PAIR_PTX = tl.constexpr("""{
.reg .b32 t, nz, a, b;
mov.b32 nz, 0x80008000;
mov.b32 a, 0x7F007F00;
mov.b32 b, 0x73007300;
mul.lo.u32 t, $1, 0x00100010;
fma.rn.bf16x2 t, t, a, nz;
fma.rn.bf16x2 $0, t, b, nz;
}""")
MXFP4_FOLDED_MAX_CODE = 128   # the largest e8m0 code whose factor 2^(s - 1) bf16 holds
NVFP4_WORD_SHIFT = 16         # NVFP4's decoded values are the block-scaled ones times 2^-16


@triton.jit
def e2m1_words_bf16(words, scale_pair, WIDE: tl.constexpr):
    """Packed codes as 32-bit words [BN, BK/8] (4 bytes of a row each, as stored) and each word's
    scale factor as a bf16 pair [BN, BK/8] (uint32, both halves: mxfp4_scale_pair's or
    nvfp4_scale_pair's) -> the values [BN, BK] in bf16, K order (element 2j, 2j+1 from byte j). A
    word's 8 values share one scale group (groups of 16 or 32, words at multiples of 8). WIDE: the
    program with the product by 2^126 first (MXFP4 scale codes past MXFP4_FOLDED_MAX_CODE).

    Why words: 8-bit elements reach inline asm packed 4 to a register in the order the consumer's
    layout gives a thread's elements, which for a wgmma left operand alternates rows r and r + 8;
    bytes would cost two prmt a word to gather, a word loaded whole costs none."""
    d0, d1, d2, d3 = tl.inline_asm_elementwise(_E2M1_WORD_PTX_WIDE if WIDE else _E2M1_WORD_PTX,
                                               "=r,=r,=r,=r,r,r", [words, scale_pair],
                                               dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    d = bytes_in_order(d0, d1, d2, d3)
    return tl.interleave(d.to(tl.uint16).to(tl.bfloat16, bitcast=True),
                         (d >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def bytes_in_order(d0, d1, d2, d3):
    """Four [R, W] tensors, d<b>[r, w] of byte b of word w -> [R, 4 W], byte 4 w + b at 4 w + b:
    join(join(d0, d2), join(d1, d3))[r, w, i, o] is byte 2 i + o."""
    return tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (d0.shape[0], 4 * d0.shape[1]))


@triton.jit
def mxfp4_scale_pair(codes, WIDE: tl.constexpr):
    """e8m0 scale codes (uint8) -> words holding each one's factor in both bf16 halves: 2^(s - 1),
    the e2m1 pairs' 2^126 folded in (exponent field s + 126, one multiply-add; codes up to
    MXFP4_FOLDED_MAX_CODE), or with WIDE the value 2^(s - 127) itself in two operations: code s >= 1
    is bf16's exponent field, code 0 (2^-127) bf16's subnormal 0x0040, which the unsigned maximum
    picks exactly there (every other pair is above it)."""
    if WIDE:
        pair = tl.maximum(codes.to(tl.uint32) * 0x00800080, 0x00400040)
    else:
        pair = codes.to(tl.uint32) * 0x00800080 + 0x3F003F00
    return pair


@triton.jit
def nvfp4_scale_pair(codes):
    """Unsigned e4m3 scale codes (uint8, UE4M3: a sign or NaN is refused at load, reference.
    check_nvfp4_scales) -> words holding each scale times 2^110 in both bf16 halves (the words
    program's factor: its values times 2^-126, the scales' times 2^126, less 2^16 that the kernels'
    accumulators take back: nvfp4_words_restored), exactly, e4m3's subnormals included."""
    return tl.inline_asm_elementwise(_NVFP4_SCALE_PAIR_PTX, "=r,r", [codes.to(tl.uint32)], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def nvfp4_words_restored(acc):
    """An accumulator over NVFP4 weights decoded by the words program (their values times
    2^-NVFP4_WORD_SHIFT) times 2^16: the sums over the weights as they are, exactly (a power of two)."""
    return acc * 65536.0


def largest_code(scale: torch.Tensor) -> int | None:
    """The largest code in `scale` (uint8), read from the device once after each write: kept on the
    tensor with its version counter, which every in-place write through it or its views moves (not
    one through `.data`, an alias with a counter of its own: kdaserve's loaders write through the
    parameters, models/weight_names.load_named_tensor). None where it cannot be read without a
    device sync the caller must not make (a CUDA graph capturing; the engine runs each batch size
    once before capturing it) or an inference tensor (no version counter)."""
    if scale.is_inference():
        return None
    kept = getattr(scale, "_kdaserve_largest_code", None)
    if kept is not None and kept[0] == scale._version:
        return kept[1]
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    largest = int(scale.max()) if scale.numel() else 0
    scale._kdaserve_largest_code = (scale._version, largest)
    return largest


def mxfp4_scales_fold(*scales: torch.Tensor) -> bool:
    """Whether MXFP4 weights with these scales take the words program that folds 2^126 into the
    scale (every code known and at most MXFP4_FOLDED_MAX_CODE), not the WIDE one."""
    return all((c := largest_code(s)) is not None and c <= MXFP4_FOLDED_MAX_CODE for s in scales)


def words_wide(words: bool, group: int, *scales: torch.Tensor) -> bool:
    """Whether 4-bit weights decoded by the words program (`words`) in groups of `group` take its WIDE
    program: MXFP4 whose scales (`scales`, every tensor the launch reads) do not all fold."""
    return words and group == 32 and not mxfp4_scales_fold(*scales)


def words_fit(*packed: torch.Tensor) -> bool:
    """Whether packed 4-bit codes (uint8, the last dimension contiguous) load as 32-bit words
    (tiles.fp4_packed's WORDS): each tensor's start, its rows (and expert slices) and its row length
    whole words apart, so every word the kernels read is 4-byte aligned and inside one row."""
    return all(t.data_ptr() % 4 == 0 and t.shape[-1] % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1])
               for t in packed)


def words_decode(x: torch.Tensor, left: bool, forced: bool | None, *packed: torch.Tensor) -> bool:
    """Whether 4-bit GEMMs beside activations `x` decode their weights by the words program: by
    default where the tiles are left of the dots (`left`), x is bf16 on an NVIDIA GPU and the
    weights' packed codes (`packed`) load as whole 32-bit words; `forced` True / False decides
    instead (tests, benchmarks), True refused where the program cannot run."""
    fits = x.dtype == torch.bfloat16 and words_run_on(x.device) and words_fit(*packed)
    if forced and not fits:
        raise ValueError(f"the 4-bit words decoder needs bf16 activations on an NVIDIA GPU (not the interpreter) "
                         f"and packed codes in whole 4-byte words (start, rows and row length); got {x.dtype} on "
                         f"{x.device}, codes {[(list(t.shape), t.stride(), t.data_ptr() % 4) for t in packed]}")
    return fits and left if forced is None else forced


def words_run_on(device: torch.device) -> bool:
    """Whether the words decoder can run on `device`: an NVIDIA GPU (PTX), not the interpreter."""
    return device.type == "cuda" and not torch.version.hip and not triton.knobs.runtime.interpret
