"""e2m1 codes decoded by byte tables (PTX `prmt`), the group scale applied in the same asm: the
"tables" decoder, which the 4-bit GEMMs take on NVIDIA GPUs with bf16 activations where their decoded
tiles are the dots' left operands (tiles.fp4_weights_left: Hopper's decode); tiles.py's bitwise
decoding everywhere else.

Why: a 32-bit word of codes arrives whole where the tiles are left of the dots (fragment order: a
thread's bytes side by side), and there the decode kernels come close to bound by instruction issue.
The bitwise decoding spends per byte an extraction, two integer products and two masks, then two bf16
products a pair (by 2^126 and by the scale); the tables spend per 4 bytes 10 `prmt`, 5 other integer
operations and, a pair, one scale product (the scale arrives as a bf16 pair, one register a word).
Beside left tiles that is what makes them faster; beside right tiles (mma.sync) the tables gain
nothing (timings: docs/perf-notes.md, fortieth session). The codes load as 32-bit words, not bytes:
bytes reach the asm packed in the register order of the wgmma operand, which alternates rows, and
gathering them cost two more `prmt` a word (docs/perf-notes.md).

How (`_E2M1_SCALED_PTX`, one 32-bit word of packed codes, element 2k in byte k's low nibble): each
nibble's 3 magnitude bits select a byte of the bf16 patterns of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000,
0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0): low bytes from (lo0, lo1), high bytes from
(hi0, hi1). Signs: byte k of the word holds element 2k+1's sign in bit 7, byte k of the word shifted
left by 4 element 2k's; a prmt gathers those bytes and their bit 7 joins the high bytes. Then byte
k's two values are one bf16 pair, multiplied by its scale, exactly (an e2m1 value times a power of
two or an e4m3 value fits bf16), as an fma adding -0: sm_80 and sm_89 have no bf16x2 product.
NVFP4's program (`_E2M1_SCALED_PTX_E4M3`) tables the values times 2^120 and takes each e4m3 scale as
its code shifted by 4, the value times 2^-120 (nvfp4_scale_pair: one product a scale, where a
conversion through fp16 and fp32 takes about ten; counts in docs/perf-notes.md).
The interpreter runs no inline asm: tests/ops/test_fp4.py executes this very program in Python
over every byte in every position, and on a GPU compares both decoders bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_E2M1_SCALED_PTX_TEMPLATE = """{
.reg .b32 m, mh, ws, l0, l1, h0, h1, s0, s1, lo0, lo1, hi0, hi1, p0, p1, p2, p3, nz;
mov.b32 nz, 0x80008000;
mov.b32 lo0, 0xC0800000;
mov.b32 lo1, 0xC0804000;
mov.b32 hi0, HI0;
mov.b32 hi1, HI1;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 l0, lo0, lo1, m;
prmt.b32 h0, hi0, hi1, m;
prmt.b32 l1, lo0, lo1, mh;
prmt.b32 h1, hi0, hi1, mh;
shl.b32 ws, $4, 4;
prmt.b32 s0, ws, $4, 0xD9C8;
prmt.b32 s1, ws, $4, 0xFBEA;
lop3.b32 h0, h0, s0, 0x80808080, 0xF8;
lop3.b32 h1, h1, s1, 0x80808080, 0xF8;
prmt.b32 p0, l0, h0, 0x5140;
prmt.b32 p1, l0, h0, 0x7362;
prmt.b32 p2, l1, h1, 0x5140;
prmt.b32 p3, l1, h1, 0x7362;
fma.rn.bf16x2 $0, p0, $5, nz;
fma.rn.bf16x2 $1, p1, $5, nz;
fma.rn.bf16x2 $2, p2, $5, nz;
fma.rn.bf16x2 $3, p3, $5, nz;
}"""
# The high bytes of 0, 0.5, ..., 6 in bf16; for e4m3 scales (NVFP4) those of the values times 2^120
# (exponent field + 120), which nvfp4_scale_pair's scales times 2^-120 take back exactly.
_E2M1_SCALED_PTX = tl.constexpr(_E2M1_SCALED_PTX_TEMPLATE.replace("HI0", "0x3F3F3F00").replace("HI1", "0x40404040"))
_E2M1_SCALED_PTX_E4M3 = tl.constexpr(_E2M1_SCALED_PTX_TEMPLATE.replace("HI0", "0x7B7B7B00").replace("HI1", "0x7C7C7C7C"))


@triton.jit
def e2m1_scaled_bf16(words, scale_pair, GROUP: tl.constexpr):
    """Packed codes as 32-bit words [BN, BK/8] (4 bytes of a row each, as stored) and each word's
    scale as a bf16 pair [BN, BK/8] (uint32, both halves: mxfp4_scale_pair's, or for GROUP 16
    nvfp4_scale_pair's, the e4m3 value times 2^-120) -> the values [BN, BK] in bf16, K order (element
    2j, 2j+1 from byte j). A word's 8 values share one scale group (groups of 16 or 32, words at
    multiples of 8).

    Why words: 8-bit elements reach inline asm packed 4 to a register in the order the consumer's
    layout gives a thread's elements, which for a wgmma left operand alternates rows r and r + 8;
    bytes would cost two prmt a word to gather, a word loaded whole costs none."""
    d0, d1, d2, d3 = tl.inline_asm_elementwise(_E2M1_SCALED_PTX_E4M3 if GROUP == 16 else _E2M1_SCALED_PTX,
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
def nvfp4_scale_pair(codes):
    """Unsigned e4m3 scale codes (uint8, UE4M3: a sign or NaN is refused at load, reference.
    check_nvfp4_scales) -> words holding each scale times 2^-120 in both bf16 halves (the e4m3 tables'
    form), in one product: the code shifted by 4 is bf16's exponent field (e4m3's, whose bias is 120
    less) and mantissa, exactly, e4m3's subnormals bf16's. A sign would cost the product three more
    operations a scale, hence unsigned scales only."""
    return codes.to(tl.uint32) * 0x00100010


@triton.jit
def mxfp4_scale_pair(codes):
    """e8m0 scale codes (uint8) -> words holding their bf16 values in both halves, in two operations: code
    s >= 1 is bf16's exponent field (s << 7, both halves by one product), code 0 (2^-127) bf16's
    subnormal 0x0040, which the unsigned maximum picks exactly there (every other pair is above it)."""
    return tl.maximum(codes.to(tl.uint32) * 0x00800080, 0x00400040)


def words_fit(*packed: torch.Tensor) -> bool:
    """Whether packed 4-bit codes (uint8, the last dimension contiguous) load as 32-bit words
    (tiles.fp4_packed's WORDS): each tensor's start, its rows (and expert slices) and its row length
    whole words apart, so every word the kernels read is 4-byte aligned and inside one row."""
    return all(t.data_ptr() % 4 == 0 and t.shape[-1] % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1])
               for t in packed)


def tables_decode(x: torch.Tensor, left: bool, forced: bool | None, *packed: torch.Tensor) -> bool:
    """Whether 4-bit GEMMs beside activations `x` decode their weights by the tables: by default
    where the tiles are left of the dots (`left`), x is bf16 on an NVIDIA GPU and the weights' packed
    codes (`packed`) load as whole 32-bit words; `forced` True / False decides instead (tests,
    benchmarks), True refused where the tables cannot run."""
    fits = x.dtype == torch.bfloat16 and tables_run_on(x.device) and words_fit(*packed)
    if forced and not fits:
        raise ValueError(f"the 4-bit byte-table decoder needs bf16 activations on an NVIDIA GPU (not the interpreter) "
                         f"and packed codes in whole 4-byte words (start, rows and row length); got {x.dtype} on "
                         f"{x.device}, codes {[(list(t.shape), t.stride(), t.data_ptr() % 4) for t in packed]}")
    return fits and left if forced is None else forced


def tables_run_on(device: torch.device) -> bool:
    """Whether the tables decoder can run on `device`: an NVIDIA GPU (PTX), not the interpreter."""
    return device.type == "cuda" and not torch.version.hip and not triton.knobs.runtime.interpret
