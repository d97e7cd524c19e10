"""4-bit weights inside Triton GEMMs (ops/fp4/tiles.py): the fused MoE kernels' W4 path and the 4-bit
linear layer (ops/fp4/linear.py), against the definition, the torch path over the dequantized
weights (ops/fp4/reference.py). The decoders exactly, over every byte and every scale code; the
GEMMs on fresh random weights in both formats, at every launch shape and routing mode (CPU: the
interpreter in fp32, fp16 and bf16; GPU: bf16 at Kimi-Linear's sizes)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kdaserve.ops.fp4.reference import e2m1_values, quantize_mxfp4, quantize_nvfp4
from kdaserve.ops.fp4.tiles import (
    e2m1_bf16_pair,
    e2m1_pair,
    fp4_packed,
    fragment_order_k,
    group_scale,
    group_scale_bf16,
    in_fragment_order,
)
from kdaserve.ops.fp4.weights import Fp4Weights
from kdaserve.ops.fp4.word_decode import bytes_in_order, e2m1_words_bf16, mxfp4_scale_pair, nvfp4_scale_pair
from kdaserve.ops.moe import RouterConfig, moe_experts_reference, route_tokens
from kdaserve.testing.compare import assert_rel_close

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
RUNS_TRITON = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs a GPU or TRITON_INTERPRET=1")
SCHEMES = ["mxfp4", "nvfp4"]


def fp4_stack(weights: torch.Tensor, scheme: str) -> Fp4Weights:
    """[E, rows, cols] full-precision weights quantized expert by expert into the kept form."""
    packed, scales, divisors = [], [], []
    for w in weights.float():   # on the weights' device (a GPU test quantizes 256 experts there)
        if scheme == "mxfp4":
            p, s = quantize_mxfp4(w)
        else:
            p, s, g = quantize_nvfp4(w)
            s = s.view(torch.uint8)
            divisors.append(g.expand(w.shape[0]))
        packed.append(p)
        scales.append(s)
    dev = weights.device
    return Fp4Weights(torch.stack(packed).to(dev), torch.stack(scales).to(dev),
                      torch.stack(divisors).to(dev) if divisors else None, 32 if scheme == "mxfp4" else 16)


def fp4_experts(E, hidden, inter, scheme, *, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, hidden, generator=g, device=device) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=g, device=device) * inter**-0.5
    return fp4_stack(w13, scheme), fp4_stack(w2, scheme)


def _routing(T, E, k, mode, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mode == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:                                             # "one-expert": every token's first choice is expert 0
        ids = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(E - 1, generator=g)[: k - 1] + 1]) for _ in range(T)])
    return torch.rand(T, k, generator=g) + 0.1, ids


# ---- the decoders, exactly -----------------------------------------------------------------------

@triton.jit
def _decode_kernel(codes_ptr, out_lo_ptr, out_hi_ptr, mx_ptr, nv_ptr):
    i = tl.arange(0, 256)
    b = tl.load(codes_ptr + i)
    lo, hi = e2m1_pair(b)
    tl.store(out_lo_ptr + i, lo)
    tl.store(out_hi_ptr + i, hi)
    tl.store(mx_ptr + i, group_scale(b, 32))
    tl.store(nv_ptr + i, group_scale(b, 16))


@RUNS_TRITON
def test_the_decoders_give_every_code_its_value_exactly():
    """All 256 bytes as a pair of e2m1 codes, as an e8m0 scale and as e4m3 scale bits: bit for bit
    the definitions' values (subnormals included: e2m1's 0.5, e8m0's 2^-127, e4m3's 2^-9)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    lo, hi, mx, nv = (torch.full((256,), float("nan"), device=device) for _ in range(4))
    _decode_kernel[(1,)](codes, lo, hi, mx, nv)
    values = e2m1_values(device)
    assert torch.equal(lo, values[(codes & 0xF).long()]) and torch.equal(hi, values[(codes >> 4).long()])
    want_mx = torch.exp2(codes.double() - 127).float()
    assert torch.equal(mx[:255], want_mx[:255])               # 255 is NaN: refused at load, never decoded
    want_nv = codes.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(want_nv)
    assert torch.equal(nv[finite], want_nv[finite]) and (~finite).sum() == 2


@triton.jit
def _decode_bf16_kernel(codes_ptr, scales_ptr, out_ptr, GROUP: tl.constexpr):
    """out[s, 2b + j] = nibble j of byte b times scale code s, as the bf16 GEMMs decode it."""
    b = tl.arange(0, 256)
    s = tl.arange(0, 256)
    lo, hi = e2m1_bf16_pair(tl.load(codes_ptr + b))
    g = group_scale_bf16(tl.load(scales_ptr + s), GROUP)[:, None]
    w = tl.interleave(lo, hi)[None, :] * (2.0 ** 126) * g
    tl.store(out_ptr + s[:, None] * 512 + tl.arange(0, 512)[None, :], w)


@RUNS_TRITON
@pytest.mark.parametrize("scheme", SCHEMES)
# the interpreter warns where the top scale codes overflow to inf (and NaN's code times zero): meant
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_the_bf16_decoders_give_every_code_times_every_scale_exactly(scheme):
    """The bf16 path (a byte's two values as one register's halves, times 2^126, times the scale):
    every byte under every scale code equals the definition's value, bit for bit (e2m1's 0.5 as a
    bf16 subnormal, e8m0 from 2^-127 up to where the value overflows to inf in fp32 too)."""
    from kdaserve.ops import interpreter_compat

    interpreter_compat.install()   # the interpreter's bf16 arithmetic (the kernels' wrappers install it)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    group = 32 if scheme == "mxfp4" else 16
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    out = torch.full((256, 512), float("nan"), dtype=torch.bfloat16, device=device)
    _decode_bf16_kernel[(1,)](codes, codes, out, GROUP=group)
    values = e2m1_values(device)[torch.stack([codes & 0xF, codes >> 4], -1).long()].reshape(-1)
    if scheme == "mxfp4":
        factors, usable = torch.exp2(codes.double() - 127).float(), codes < 255          # 255 is NaN: refused at load
    else:
        factors = codes.view(torch.float8_e4m3fn).float()
        usable = torch.isfinite(factors)
    want = (factors[:, None] * values[None, :])[usable]
    assert torch.equal(want.bfloat16().float(), want), "every product is exact in bf16 (or inf in both)"
    assert torch.equal(out[usable].float(), want)


def _run_ptx(program: str, args: list[int], outs: int = 4) -> list[int]:
    """Execute a words-decoder PTX program (ops/fp4/word_decode.py) in Python: 32-bit registers,
    $0..$<outs - 1> out, the inputs after; mov, and, shl, mul.lo, prmt and fma.rn.bf16x2 as the PTX
    ISA defines them."""
    regs = {f"${i + outs}": v for i, v in enumerate(args)}

    def val(op):
        return regs[op] if op in regs else int(op, 0)

    def bf16(bits):
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()

    def fma_bf16(a, b, c):   # the exact a * b + c (in fp64) rounded to bf16 once (to nearest even)
        exact = bf16(a).double() * bf16(b).double() + bf16(c).double()
        return int(exact.bfloat16().view(torch.int16).item()) & 0xFFFF

    for line in program.strip("{}\n").splitlines():
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.rstrip(";").split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        x = [val(t) for t in src]
        if op == "prmt.b32":
            pool = (x[0] | x[1] << 32).to_bytes(8, "little")
            out = 0
            for i in range(4):
                sel = x[2] >> 4 * i & 0xF
                byte = pool[sel & 7]
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * i
        elif op == "fma.rn.bf16x2":
            out = fma_bf16(x[0] & 0xFFFF, x[1] & 0xFFFF, x[2] & 0xFFFF) | fma_bf16(x[0] >> 16, x[1] >> 16, x[2] >> 16) << 16
        else:
            out = {"mov.b32": lambda: x[0], "and.b32": lambda: x[0] & x[1], "shl.b32": lambda: x[0] << x[1],
                   "mul.lo.u32": lambda: x[0] * x[1]}[op]()
        regs[d] = out & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(outs)]


def _word_bytes(first: int) -> list[int]:
    """The 4 bytes first + 67 i of a word: as first runs over all 256 values, every byte lands in each
    of the 4 positions."""
    return [(first + i * 67) % 256 for i in range(4)]


def _word(first: int) -> int:
    return sum(b << 8 * i for i, b in enumerate(_word_bytes(first)))


def _bf16_bits(values: torch.Tensor) -> torch.Tensor:
    """Exact bf16 values (float64) -> their bits, int32."""
    bf = values.bfloat16()
    assert torch.equal(bf.double(), values.double()), "exact in bf16"
    return bf.view(torch.int16).int() & 0xFFFF


def _assert_program_decodes(program: str, word: int, factor_bits: int, scale: float) -> None:
    """A words program (executed by _run_ptx) on `word` with the factor `factor_bits` (bf16) in both
    halves: each byte's two values times `scale`, exactly as the definition (ops/fp4/reference.py)
    has them (every product bf16 holds is exact there; past bf16's largest, inf)."""
    values = e2m1_values().double()
    for k, pair in enumerate(_run_ptx(program, [word, factor_bits | factor_bits << 16])):
        byte = word >> 8 * k & 0xFF
        got = torch.tensor([pair & 0xFFFF, pair >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()
        want = (values[[byte & 0xF, byte >> 4]] * scale).bfloat16().double()
        assert torch.equal(got, want), (hex(word), hex(byte), scale, got, want)


def test_the_words_program_gives_every_code_times_every_mxfp4_scale_exactly():
    """The words program (ops/fp4/word_decode.py; no inline asm in the interpreter), executed over
    every byte in each of the four positions of a word, with every e8m0 scale code but NaN's 255,
    each a factor in both halves of a word as mxfp4_scale_pair makes it: each byte's two values times
    the scale, exactly as the definition has them. Codes up to 128 through the program that folds
    2^126 into the factor (2^(s - 1)), every code through the WIDE one (the scale itself)."""
    from kdaserve.ops.fp4.word_decode import _E2M1_WORD_PTX, _E2M1_WORD_PTX_WIDE, MXFP4_FOLDED_MAX_CODE

    assert MXFP4_FOLDED_MAX_CODE == 128
    for code in range(255):
        scale = 2.0 ** (code - 127)
        for first in range(code % 4, 256, 4):   # over the codes, every first: every byte in every position
            word = _word(first)
            if code <= MXFP4_FOLDED_MAX_CODE:
                _assert_program_decodes(_E2M1_WORD_PTX.value, word, int(_bf16_bits(torch.tensor(2.0 ** (code - 1)))),
                                        scale)
            _assert_program_decodes(_E2M1_WORD_PTX_WIDE.value, word, int(_bf16_bits(torch.tensor(scale))), scale)


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).double()


def test_the_words_program_gives_every_code_times_every_nvfp4_scale_exactly():
    """NVFP4 through the words program: nvfp4_scale_pair's program (executed here) gives every unsigned
    e4m3 code but NaN its value times 2^110 in both bf16 halves (subnormal codes included), and the
    words program with it each byte's two values times the scale times 2^-16, exactly (every byte in
    every position over the codes): the kernels multiply the accumulators by 2^16."""
    from kdaserve.ops.fp4.word_decode import _E2M1_WORD_PTX, _NVFP4_SCALE_PAIR_PTX, NVFP4_WORD_SHIFT

    codes = torch.arange(0x7F, dtype=torch.uint8)   # 0x7F is NaN; signed codes are refused at load
    factors = _bf16_bits(_e4m3_values(codes) * 2.0**110)
    for code in range(0x7F):
        (pair,) = _run_ptx(_NVFP4_SCALE_PAIR_PTX.value, [code], outs=1)
        assert pair == int(factors[code]) | int(factors[code]) << 16, hex(code)
        for first in range(code, 256, 127):
            _assert_program_decodes(_E2M1_WORD_PTX.value, _word(first), int(factors[code]),
                                    float(_e4m3_values(codes)[code]) * 2.0**-NVFP4_WORD_SHIFT)


def test_where_the_tiles_go_left_of_the_dots_and_decode_by_words():
    """Hopper's decode row blocks put the decoded tiles on the left (wgmma), nothing else does; the
    words decoder runs only on NVIDIA GPUs (PTX), never in the interpreter or on a CPU."""
    from kdaserve.ops.fp4.tiles import fp4_weights_left
    from kdaserve.ops.fp4.word_decode import words_run_on

    assert fp4_weights_left("sm_90", 16) and fp4_weights_left("sm_90", 32)
    assert not fp4_weights_left("sm_90", 64) and not fp4_weights_left("sm_90", 128)   # prefill stays right
    assert not any(fp4_weights_left(t, 16) for t in ("sm_89", "sm_100", "gfx942", "gfx950", "cpu"))
    assert not words_run_on(torch.device("cpu"))


@triton.jit
def _scale_pairs_kernel(codes_ptr, out_ptr):
    s = tl.load(codes_ptr + tl.arange(0, 256))
    tl.store(out_ptr + tl.arange(0, 256), mxfp4_scale_pair(s, False))
    tl.store(out_ptr + 256 + tl.arange(0, 256), mxfp4_scale_pair(s, True))


@INTERP
def test_the_mxfp4_scale_pairs_are_the_factors_in_both_halves():
    """mxfp4_scale_pair gives every e8m0 code its factor's bf16 bits in both halves of a word: 2^(s - 1)
    in one multiply-add for codes up to 128, the value 2^(s - 127) itself (WIDE) for every code but
    NaN's 255, 2^-127's subnormal (code 0) included: group_scale_bf16's values."""
    from kdaserve.ops import interpreter_compat

    interpreter_compat.install()
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.zeros(512, dtype=torch.int32)
    _scale_pairs_kernel[(1,)](codes, out)
    folded = _bf16_bits(torch.exp2(codes[:129].double() - 1))
    wide = _bf16_bits(torch.exp2(codes[:255].double() - 127))
    assert torch.equal(out[:129], folded | folded << 16) and torch.equal(out[256:511], wide | wide << 16)


@triton.jit
def _bytes_in_order_kernel(out_ptr, R: tl.constexpr, W: tl.constexpr):
    word = tl.arange(0, R)[:, None] * W + tl.arange(0, W)[None, :]
    d = bytes_in_order(4 * word, 4 * word + 1, 4 * word + 2, 4 * word + 3)
    tl.store(out_ptr + tl.arange(0, R)[:, None] * 4 * W + tl.arange(0, 4 * W)[None, :], d)


@triton.jit
def _packed_kernel(w_ptr, out_ptr, rows, K, stride_w, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   WORDS: tl.constexpr):
    r = tl.arange(0, BN)
    w_rows = w_ptr + r[:, None] * stride_w
    for k0 in range(0, K, BK):
        tile = fp4_packed(w_rows, (r < rows)[:, None], k0, K, BK, EVEN_K, WORDS)
        cols = k0 // (8 if WORDS else 2) + tl.arange(0, BK // (8 if WORDS else 2))
        n = K // (8 if WORDS else 2)
        tl.store(out_ptr + r[:, None] * n + cols[None, :], tile, mask=(cols < n)[None, :])


@INTERP
@pytest.mark.parametrize("K, BK", [(96, 32), (80, 32), (128, 128)], ids=["even", "masked-k", "one-step"])
def test_the_words_decoder_loads_a_rows_codes_as_the_words_stored(K, BK):
    """fp4_packed's WORDS (the words decoder's loads): each word the 4 bytes of a row as stored and
    rows past the tile's rows zero codes, as the byte loads give them, K steps past the row's end
    included."""
    from kdaserve.ops import interpreter_compat

    interpreter_compat.install()
    rows, BN = 5, 8   # rows 5..7 exist in memory (codes 1..255) and are past the tile's rows: zero codes
    packed = torch.randint(1, 256, (BN, K // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(K))
    want = torch.cat([packed[:rows], torch.zeros_like(packed[rows:])])
    for words in (False, True):
        out = (torch.full((BN, K // 8), -1, dtype=torch.int32) if words
               else torch.full((BN, K // 2), 255, dtype=torch.uint8))
        _packed_kernel[(1,)](packed, out, rows, K, packed.stride(0), BN=BN, BK=BK, EVEN_K=K % BK == 0, WORDS=words)
        assert torch.equal(out.view(torch.uint8) if words else out, want), words


@INTERP
def test_the_words_decoder_puts_each_words_four_bytes_back_in_k_order():
    """The words program decodes a word into four registers, one a byte; they go back as bytes 4w..4w+3."""
    out = torch.empty(4, 32, dtype=torch.int32)
    _bytes_in_order_kernel[(1,)](out, R=4, W=8)
    assert torch.equal(out.flatten(), torch.arange(128, dtype=torch.int32))


def test_the_words_decoder_runs_where_it_can_and_refuses_a_forced_misfit():
    """The words decoder loads packed codes as 32-bit words: a tensor's start, its rows (and expert
    slices) and its row length whole words apart. By default it decodes where the tiles are left of
    the dots, with bf16 x on an NVIDIA GPU; forced on where it cannot run (the CPU, fp16 x, codes off
    a word boundary) a clear error, never a misread."""
    from kdaserve.ops.fp4.word_decode import words_decode, words_fit

    codes = torch.zeros(3, 8, 1152, dtype=torch.uint8)
    assert words_fit(codes, codes[1], codes[:, :, 4:]) and words_fit(codes[..., :1148])
    for off_word in (codes[:, :, 1:], codes[..., :1150], torch.zeros(8, 1150, dtype=torch.uint8)[:, :1148]):
        assert not words_fit(off_word)
    x = torch.zeros(2, 2304, dtype=torch.bfloat16)
    assert not words_decode(x, True, None, codes) and not words_decode(x, True, False, codes)
    for bad in (x, x.half()):
        with pytest.raises(ValueError, match="words decoder needs bf16 activations on an NVIDIA GPU"):
            words_decode(bad, True, True, codes)


def test_the_largest_scale_code_is_read_once_after_each_write():
    """largest_code reads a scale tensor's largest code from the device once after each write (kept
    with the tensor's version counter), so the kernels' choice of program costs no sync a step; a
    write of any kind, through any view, makes it read again. MXFP4 folds 2^126 into the factor only
    where every scale's largest code is known and at most 128."""
    from kdaserve.ops.fp4.word_decode import largest_code, mxfp4_scales_fold, words_wide

    scale = torch.full((4, 8), 120, dtype=torch.uint8)
    reads = []
    real_max = torch.Tensor.max

    def counting_max(t, *a, **k):
        reads.append(1)
        return real_max(t, *a, **k)

    torch.Tensor.max = counting_max
    try:
        assert largest_code(scale) == 120 and largest_code(scale) == 120 and len(reads) == 1
        scale[2, 3] = 128   # a write through an index: read again
        assert largest_code(scale) == 128 and len(reads) == 2 and mxfp4_scales_fold(scale)
        scale[1].copy_(torch.full((8,), 129, dtype=torch.uint8))   # through a view, by copy_
        assert largest_code(scale) == 129 and not mxfp4_scales_fold(scale) and len(reads) == 3
        assert mxfp4_scales_fold(scale[0]) and not mxfp4_scales_fold(scale[0], scale)
        # the kernels' choice: WIDE only for MXFP4 through the words program with a scale that does not fold
        assert words_wide(True, 32, scale) and not words_wide(True, 32, scale[0])
        assert not words_wide(False, 32, scale) and not words_wide(True, 16, scale)
    finally:
        torch.Tensor.max = real_max
    with torch.inference_mode():   # an inference tensor has no version counter: never taken as known
        made_there = torch.zeros(4, dtype=torch.uint8)
    assert largest_code(made_there) is None and not mxfp4_scales_fold(made_there)


def test_the_loaders_writes_of_4bit_scales_are_seen_by_the_largest_code():
    """A scale written again after the kernels read its largest code (weights reloaded in place)
    is read again: the loaders write through the parameters, whose version counters move (a write
    through `.data` would not), a merged layer's shard and a named parameter alike."""
    from kdaserve.layers.linear import Fp4Linear, MergedLinear
    from kdaserve.models.weight_names import load_named_tensor
    from kdaserve.ops.fp4.word_decode import largest_code

    merged = MergedLinear(64, [32, 32], fp4="mxfp4")
    merged.packed_modules = {}
    assert largest_code(merged.weight_scale) == 0
    merged.load_shard("weight_scale", 1, torch.full((32, 2), 131, dtype=torch.uint8))
    assert largest_code(merged.weight_scale) == 131
    root = torch.nn.Module()
    root.proj = Fp4Linear(64, 32, "mxfp4")
    assert largest_code(root.proj.weight_scale) == 0
    assert load_named_tensor(root, "proj.weight_scale", torch.full((32, 2), 140, dtype=torch.uint8))
    assert largest_code(root.proj.weight_scale) == 140


def test_hoppers_left_side_decode_takes_its_own_launch_shapes():
    """sm_90's 4-bit decode with the tiles left of the dots in row blocks of 16 (swept there, forty-first
    session): down in 128 columns, K steps of 128; gate|up K steps of 256 where they divide hidden.
    The right side, 32-row blocks, prefill, bf16 experts and other targets keep the shapes before."""
    from kdaserve.ops.moe.fused import moe_tiles

    def shapes(slots, target, four_bit=True, fp4_left=None, hidden=2304):
        t = moe_tiles(slots, 256, hidden, 1024, False, target, four_bit=four_bit, fp4_left=fp4_left)
        return t.block_m, t.gate_up, t.down

    assert shapes(512, "sm_90") == (16, (64, 256, 4, 3), (128, 128, 4, 3))
    assert shapes(512, "sm_90", hidden=2112)[1] == (64, 128, 4, 3)   # 256 does not divide hidden: no K mask
    before = (16, (64, 128, 4, 3), (64, 256, 4, 3))
    assert shapes(512, "sm_90", fp4_left=False) == before == shapes(512, "sm_100")
    assert shapes(512, "sm_90", four_bit=False)[1:] == ((64, 128, 4, 3), (64, 128, 4, 3))
    assert shapes(6144, "sm_90")[2] == (64, 256, 4, 3)               # 32-row blocks: untimed, as before
    assert shapes(32768, "sm_90")[0] == 128                           # prefill: its own shapes


# ---- the fused GEMMs -----------------------------------------------------------------------------

@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode, T, E, k", [("random", 13, 8, 3), ("one-expert", 20, 6, 2), ("random", 1, 16, 4)])
def test_fused_4bit_experts_match_the_reference(scheme, mode, T, E, k):
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = fp4_experts(E, 64, 96, scheme, seed=T)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(T, E, k, mode)
    want = moe_experts_reference(x, w13, w2, weights, ids)
    assert_rel_close(moe_experts_fused(x, w13, w2, weights, ids), want, 1e-5, f"4-bit fused MoE ({scheme}, {mode})")
    # the definition: the same numbers as the full-precision experts they dequantize to
    assert torch.equal(want, moe_experts_reference(x, w13.dequantized(x.dtype), w2.dequantized(x.dtype), weights, ids))


@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tiles", [
    (16, (16, 32, 4, 2), (16, 32, 4, 3)),    # K stepped by 32 (two dots of 16): no K mask
    (32, (32, 64, 4, 1), (32, 64, 4, 1)),    # 32 rows per program, K steps of 64
    (16, (16, 128, 4, 2), (16, 128, 4, 2)),  # K steps wider than hidden (96) and I (64): masked
    (16, (16, 16, 4, 2), (16, 16, 4, 2)),    # a K step under 32 is widened to 32 (halves of at least 16)
], ids=["even-k", "wide-rows", "masked-k", "narrow-k"])
def test_fused_4bit_experts_at_every_launch_shape(scheme, tiles):
    from kdaserve.ops.moe.fused import MoeTiles, moe_experts_fused

    w13, w2 = fp4_experts(6, 96, 64, scheme, seed=1)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(11, 6, 3, "random")
    got = moe_experts_fused(x, w13, w2, weights, ids, tiles=MoeTiles(*tiles), activation_limit=0.5)
    want = moe_experts_reference(x, w13, w2, weights, ids, activation_limit=0.5)
    assert_rel_close(got, want, 1e-5, f"4-bit fused MoE at {tiles}")


@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T, left", [(1, False), (13, False), (13, True)])
def test_a_4bit_shared_expert_runs_as_one_more_expert(scheme, T, left):
    """`shared` with 4-bit routed experts: a shared expert in their form (its packed codes, scales and
    divisors apart from theirs, scale rows 16 bytes apart as the layers store them) as expert E,
    weight 1: the reference's routed output plus the shared MLP over its dequantized weights; one in
    another form or layout is refused by name."""
    from kdaserve.ops.activation.swiglu import swiglu_reference
    from kdaserve.ops.moe.fused import moe_experts_fused

    E, k, hidden, inter = 6, 3, 64, 96
    w13, w2 = fp4_experts(E + 1, hidden, inter, scheme, seed=21)
    w13, w2 = w13.with_aligned_scales(), w2.with_aligned_scales()

    def apart(w):   # its own storage, as a layer holds the routed and the shared weights
        divisor = None if w.divisor is None else w.divisor.clone()
        return Fp4Weights(w.packed.clone(), w.scale.clone(), divisor, w.group).with_aligned_scales()

    routed13, routed2, s13, s2 = apart(w13[:E]), apart(w2[:E]), apart(w13[E]), apart(w2[E])
    weights, ids = _routing(T, E, k, "random", seed=T)
    ext_w, ext_ids = torch.cat([weights, torch.ones(T, 1)], 1), torch.cat([ids, torch.full((T, 1), E)], 1)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(22)).to(dtype)
        got = moe_experts_fused(x, routed13, routed2, ext_w, ext_ids, shared=(s13, s2), fp4_left=left)
        xf = x.float()
        want = (moe_experts_reference(xf, routed13, routed2, weights, ids)
                + swiglu_reference(xf @ s13.dequantized(torch.float32).T) @ s2.dequantized(torch.float32).T)
        assert_rel_close(got.float(), want, 1e-5 if dtype == torch.float32 else 2e-3, f"4-bit shared expert {dtype}")
    unaligned = Fp4Weights(s13.packed, s13.scale.contiguous(), s13.divisor, s13.group)
    other = fp4_stack(torch.randn(1, 2 * inter, hidden), "nvfp4" if scheme == "mxfp4" else "mxfp4")[0]
    for bad in (unaligned, other, s13.dequantized(torch.float32)):
        with pytest.raises(ValueError, match="shared expert run with 4-bit routed experts needs their form"):
            moe_experts_fused(x, routed13, routed2, ext_w, ext_ids, shared=(bad, s2))


@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tiles", [
    (16, (16, 32, 4, 2), (16, 32, 4, 3)),     # K steps of 32: 4 bytes a thread's share of a row
    (32, (32, 64, 4, 1), (32, 128, 4, 1)),    # 32 rows per program; the down kernel's K masked (128 > 64)
    (16, (16, 128, 4, 2), (16, 64, 4, 2)),    # gate|up's K step past hidden (96): masked
    (16, (16, 32, 4, 2), (64, 32, 4, 2), 128, 128),   # down's columns past hidden (96); register caps (GPU only)
], ids=["even-k", "wide-rows", "masked-k", "wide-down-capped"])
def test_decoded_tiles_on_the_left_of_the_dots_in_fragment_order(scheme, tiles):
    """W4_LEFT (acc^T = W x^T, K in fragment order on both sides: ops/fp4/tiles.in_fragment_order):
    the reference's numbers at every launch shape, fp16 activations too; and the order itself, a
    permutation of the K step that keeps each pair and gives each of 4 threads BK/8 adjacent pairs."""
    from kdaserve.ops.moe.fused import MoeTiles, moe_experts_fused

    w13, w2 = fp4_experts(6, 96, 64, scheme, seed=3)
    weights, ids = _routing(11, 6, 3, "random", seed=6)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(11, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
        want = moe_experts_reference(x.float(), w13, w2, weights, ids, activation_limit=0.5)
        got = moe_experts_fused(x, w13, w2, weights, ids, tiles=MoeTiles(*tiles), activation_limit=0.5, fp4_left=True)
        assert_rel_close(got.float(), want, 1e-5 if dtype == torch.float32 else 2e-3, f"left operands at {tiles} {dtype}")
    for BK in (32, 128):
        offsets = _fragment_order(BK)
        assert sorted(offsets) == list(range(BK)) and all(offsets[2 * q + 1] == offsets[2 * q] + 1 for q in range(BK // 2))
        pairs = [offsets[2 * q] // 2 for q in range(BK // 2)]
        for t in range(4):   # pairs q = t, t + 4, t + 8 ...: one thread's share of an operand row
            assert pairs[t::4] == list(range(t * BK // 8, (t + 1) * BK // 8))


@triton.jit
def _fragment_orders(offsets_ptr, moved_ptr, BK: tl.constexpr):
    tl.store(offsets_ptr + tl.arange(0, BK), fragment_order_k(BK))
    rows = tl.arange(0, 2)[:, None] * 0 + tl.arange(0, BK)[None, :]
    tl.store(moved_ptr + tl.arange(0, 2)[:, None] * BK + tl.arange(0, BK)[None, :], in_fragment_order(rows))


def _fragment_order(BK: int) -> list[int]:
    """fragment_order_k's offsets, checked to be in_fragment_order's order of a tile's K positions."""
    offsets, moved = torch.empty(BK, dtype=torch.int32), torch.empty(2, BK, dtype=torch.int32)
    _fragment_orders[(1,)](offsets, moved, BK=BK)
    assert torch.equal(moved[0], offsets) and torch.equal(moved[1], offsets), "the tile's order is the offsets' order"
    return offsets.tolist()


@INTERP
@pytest.mark.parametrize("scheme, tiles", [("mxfp4", (16, (64, 64, 2, 2), (32, 64, 2, 2))),
                                           ("nvfp4", (16, (32, 64, 2, 2), (32, 64, 2, 2)))])
def test_gate_and_up_scales_in_one_load_and_scale_rows_16_bytes_apart(scheme, tiles):
    """The gate|up kernel's paired scale load (ops/fp4/tiles.fp4_scale_pair), at a launch shape where
    the wrapper picks it, with K masked (hidden 96 = 64 + 32) and rows past the width (MXFP4: 96 of
    2 x 64; NVFP4: 80 of 3 x 32); with the scales packed back to back and in the layers' storage
    (rows 16 bytes apart), which the kernels read in place."""
    from kdaserve.ops.fp4.tiles import scale_pair_pipelines
    from kdaserve.ops.moe.fused import MoeTiles, moe_experts_fused

    group = 32 if scheme == "mxfp4" else 16
    bn, bk, warps, _ = tiles[1]
    assert scale_pair_pipelines(bn, bk, group, warps)
    # NVFP4's decode tile (K steps of 128, 4 warps) alone gives a thread 4 bytes; prefill's pair would give 1
    assert not scale_pair_pipelines(64, 128, 16, 4) and not scale_pair_pipelines(64, 64, 32, 8)
    w13, w2 = fp4_experts(5, 96, 96 if scheme == "mxfp4" else 80, scheme, seed=11)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(12))
    weights, ids = _routing(7, 5, 3, "random", seed=4)
    want = moe_experts_reference(x, w13, w2, weights, ids)
    got = moe_experts_fused(x, w13, w2, weights, ids, tiles=MoeTiles(*tiles))
    assert_rel_close(got, want, 1e-5, f"4-bit fused MoE, paired scales ({scheme})")
    a13, a2 = w13.with_aligned_scales(), w2.with_aligned_scales()
    assert a13.scale.stride(-2) % 16 == 0 and a2.scale.stride(-2) % 16 == 0 and torch.equal(a13.scale, w13.scale)
    assert a13.dense_rows().scale.data_ptr() == a13.scale.data_ptr(), "aligned scale rows are read in place"
    assert torch.equal(moe_experts_fused(x, a13, a2, weights, ids, tiles=MoeTiles(*tiles)), got)


def test_scale_storage_pads_rows_to_16_bytes():
    from kdaserve.layers.linear import Fp4Linear
    from kdaserve.layers.moe import MoEMLP
    from kdaserve.ops.fp4.weights import scale_row_bytes, scale_storage
    from kdaserve.ops.moe import RouterConfig

    assert [scale_row_bytes(n) for n in (1, 16, 72, 144)] == [16, 16, 80, 144]
    s = scale_storage(3, 5, 72)
    assert s.shape == (3, 5, 72) and s.stride() == (400, 80, 1) and not s.any()
    moe = MoEMLP(2304, RouterConfig(4, 2), 64, fp4="mxfp4")   # Kimi-Linear's hidden: 72 groups a row
    assert moe.w13_scale.stride()[1:] == (80, 1) and moe.w2_scale.stride()[1:] == (16, 1)
    assert Fp4Linear(2304, 16, "nvfp4").weight_scale.stride() == (144, 1)


@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_4bit_experts_in_half_precision_equal_the_full_precision_kernel(scheme):
    """fp16 activations: the decoded weights are exact in fp16, so the W4 kernel follows the same
    kernel on the dequantized fp16 experts to the last bits of its accumulation order."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = fp4_experts(5, 64, 64, scheme, seed=3)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).half()
    weights, ids = _routing(9, 5, 2, "random")
    got = moe_experts_fused(x, w13, w2, weights, ids)
    twin = moe_experts_fused(x, w13.dequantized(torch.float16), w2.dequantized(torch.float16), weights, ids)
    assert_rel_close(got.float(), twin.float(), 2e-3, f"4-bit fp16 ({scheme})")


@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_4bit_experts_in_bf16_equal_the_bf16_kernel_on_the_dequantized_experts(scheme):
    """bf16 activations take the bf16 decoding (ops/fp4/tiles.e2m1_bf16_pair): the decoded weights
    are exact in bf16, so the W4 kernel follows the bf16 experts' kernel to its accumulation order."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = fp4_experts(5, 64, 96, scheme, seed=6)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7))
    if scheme == "mxfp4":   # e8m0 codes above 128 (2^73), where 2^126 times the scale would overflow bf16
        w13.scale[0, :2] = torch.where(w13.scale[0, :2] > 0, 200, 0).to(torch.uint8)
        x = x * 2.0 ** -70
    x = x.bfloat16()
    weights, ids = _routing(9, 5, 2, "random")
    got = moe_experts_fused(x, w13, w2, weights, ids)
    twin = moe_experts_fused(x, w13.dequantized(torch.bfloat16), w2.dequantized(torch.bfloat16), weights, ids)
    assert torch.isfinite(twin).all() and twin.abs().max() > 0
    # NVFP4's twin rounds each weight to bf16 after its global scale divides (the kernel divides the
    # fp32 accumulator instead): bf16's rounding apart; MXFP4's twin holds the very same weights.
    assert_rel_close(got.float(), twin.float(), 1e-3 if scheme == "mxfp4" else 1e-2, f"4-bit bf16 ({scheme})")


@INTERP
def test_scale_edges_pass_through_the_kernel():
    """Zero blocks (e8m0 code 0: 2^-127 times zeros) and large scales (code 160: 2^33) decoded
    in the GEMM as the definition has them."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = fp4_experts(2, 64, 32, "mxfp4", seed=9)
    w13.packed[0, :, :16] = 0
    w13.scale[0, :, :1] = 0                                       # expert 0's first 32 columns: a zero block
    w2.scale[1] = torch.where(w2.scale[1] > 0, 160, 0).to(torch.uint8)           # large powers of two
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    weights, ids = torch.ones(4, 2), torch.tensor([[0, 1]] * 4)
    want = moe_experts_reference(x, w13, w2, weights, ids)
    assert torch.isfinite(want).all()
    assert_rel_close(moe_experts_fused(x, w13, w2, weights, ids), want, 1e-5, "scale edges")


def test_the_4bit_form_and_its_refusals():
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = fp4_experts(2, 64, 32, "nvfp4")
    assert tuple(w13.shape) == (2, 64, 64) and w13[1].shape == (64, 64) and w13.scheme == "nvfp4"
    with pytest.raises(ValueError, match="one fp32 per row"):
        Fp4Weights(w13.packed, w13.scale, w13.divisor[:, :3], 16)
    with pytest.raises(ValueError, match="MXFP4 \\(32\\) has no divisor"):
        Fp4Weights(w13.packed, w13.scale, None, 16)
    x, weights, ids = torch.randn(3, 64), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="one 4-bit form"):
        moe_experts_fused(x, w13, fp4_experts(2, 64, 32, "mxfp4")[1], weights, ids)
    with pytest.raises(ValueError, match=r"needs their form \(nvfp4\), width .* got torch.float32, torch.float32"):
        moe_experts_fused(x, w13, w2, weights, ids, shared=(torch.zeros(64, 64), torch.zeros(64, 32)))


@INTERP
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M, N, K, bias", [(1, 80, 64, False), (13, 64, 96, True), (200, 48, 160, False)],
                         ids=["decode", "masked-k+bias", "prefill"])
def test_4bit_linear_matches_the_definition(scheme, M, N, K, bias):
    """Rows and columns past the tile edges (80 = 64 + 16, 48 < 64), K not a multiple of the K step."""
    import torch.nn.functional as F

    from kdaserve.ops.fp4.linear import fp4_linear

    g = torch.Generator().manual_seed(M)
    w = fp4_stack((torch.randn(1, N, K, generator=g) * K**-0.5), scheme)[0]
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    want = F.linear(x, w.dequantized(torch.float32), b)
    assert_rel_close(fp4_linear(x, w, b), want, 1e-5, f"4-bit linear {scheme} {M}x{N}x{K}")
    assert fp4_linear(x[:0], w).shape == (0, N)
    # bf16 activations take the bf16 decoding: the dequantized weight's bf16 GEMM
    xb = x.bfloat16()
    for left in (False, True):   # the decoded tiles on either side of the dots (tiles.fp4_weights_left)
        assert_rel_close(fp4_linear(xb, w, fp4_left=left).float(), F.linear(xb.float(), w.dequantized(torch.float32)),
                         1e-2, f"4-bit linear {scheme} bf16 {M}x{N}x{K} left={left}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 64, 4096])
def test_gpu_4bit_linear_at_glm_shared_expert_sizes(scheme, M):
    """A shared expert's gate|up (4096 rows over hidden 6144) in bf16 against the fp32 definition."""
    import torch.nn.functional as F

    from kdaserve.ops.fp4.linear import fp4_linear

    g = torch.Generator(device="cuda").manual_seed(M)
    w = fp4_stack(torch.randn(1, 4096, 6144, device="cuda", generator=g) * 6144**-0.5, scheme)[0]
    x = torch.randn(M, 6144, device="cuda", generator=g).bfloat16()
    assert_rel_close(fp4_linear(x, w).float(), F.linear(x.float(), w.dequantized(torch.float32)), 1e-2,
                     f"4-bit linear {scheme} bf16 M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gpu_fused_4bit_experts_at_kimi_linear_sizes(scheme, T):
    """256 experts of width 1024 on hidden 2304, top 8, the router's own choices, bf16 activations:
    within bf16's rounding of the fp32 reference over the dequantized experts."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    E, k, hidden, inter = 256, 8, 2304, 1024
    w13, w2 = fp4_experts(E, hidden, inter, scheme, device="cuda", seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, hidden, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, hidden, device="cuda", generator=g) * hidden**-0.5
    weights, ids = route_tokens(x, gate, None, RouterConfig(E, k, routed_scaling_factor=2.446))
    got = moe_experts_fused(x, w13, w2, weights, ids)
    want = moe_experts_reference(x.float(), w13, w2, weights, ids)
    assert_rel_close(got.float(), want, 1e-2, f"4-bit fused MoE {scheme} bf16 T={T}")


def _gpu_step(scheme: str, T: int, E: int, seed_w: int, seed_x: int, extra: int = 0):
    """E (+ extra) 4-bit experts at Kimi-Linear's sizes on the GPU, scale rows aligned as the layers
    store them, T bf16 tokens and a top-8 router's choices among the first E: (x, w13, w2, weights, ids)."""
    hidden, inter = 2304, 1024
    w13, w2 = fp4_experts(E + extra, hidden, inter, scheme, device="cuda", seed=seed_w)
    g = torch.Generator(device="cuda").manual_seed(seed_x)
    x = torch.randn(T, hidden, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, hidden, device="cuda", generator=g) * hidden**-0.5
    weights, ids = route_tokens(x, gate, None, RouterConfig(E, 8))
    return x, w13.with_aligned_scales(), w2.with_aligned_scales(), weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_4bit_shared_expert_as_one_more_expert_at_kimi_linear_sizes(scheme, T):
    """A 4-bit shared expert in the fused kernels (expert E, weight 1) at Kimi-Linear's sizes, bf16:
    within bf16's rounding of the reference's routed output plus the shared MLP's."""
    from kdaserve.ops.activation.swiglu import swiglu_reference
    from kdaserve.ops.moe.fused import moe_experts_fused

    E = 64
    x, w13, w2, weights, ids = _gpu_step(scheme, T, E, seed_w=T + 7, seed_x=T, extra=1)
    ext_w = torch.cat([weights, torch.ones(T, 1, device="cuda")], 1)
    ext_ids = torch.cat([ids, torch.full((T, 1), E, device="cuda", dtype=ids.dtype)], 1)
    got = moe_experts_fused(x, w13[:E], w2[:E], ext_w, ext_ids, shared=(w13[E], w2[E])).float()
    xf = x.float()
    want = (moe_experts_reference(xf, w13[:E], w2[:E], weights, ids)
            + swiglu_reference(xf @ w13[E].dequantized(torch.float32).T) @ w2[E].dequantized(torch.float32).T)
    assert_rel_close(got, want, 1e-2, f"4-bit shared expert {scheme} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [8, 64, 2048])
def test_gpu_decoded_tiles_on_either_side_of_the_dots(scheme, T):
    """The 4-bit expert kernels with their decoded tiles on the left of the dots (W4_LEFT: wgmma
    with the weights from registers on sm_90) and on the right, at Kimi-Linear's sizes: both
    within bf16's rounding of the reference, and of each other (only the order of the sums differs)."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    x, w13, w2, weights, ids = _gpu_step(scheme, T, 64, seed_w=T + 1, seed_x=T + 1)
    want = moe_experts_reference(x.float(), w13, w2, weights, ids)
    sides = {left: moe_experts_fused(x, w13, w2, weights, ids, fp4_left=left).float() for left in (True, False)}
    for left, got in sides.items():
        assert_rel_close(got, want, 1e-2, f"4-bit fused MoE {scheme} T={T} left={left}")
    assert_rel_close(sides[True], sides[False], 1e-2, f"left against right {scheme} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES + ["mxfp4-wide"])
@pytest.mark.parametrize("T", [8, 64, 2048])
def test_gpu_words_decoding_equals_the_bitwise_decoding(scheme, T):
    """The words decoder (ops/fp4/word_decode.py) and the bitwise one decode to the very same bf16
    weights (NVFP4's times 2^-16, which the accumulators take back exactly), so the experts and a
    4-bit linear layer give the same outputs bit for bit with either, the tiles on either side of
    the dots. mxfp4-wide: weights whose scale codes all lie past 128 (each block times one power of
    two: their words program is the WIDE one), the layer's input smaller by as much."""
    from kdaserve.ops.fp4.linear import fp4_linear
    from kdaserve.ops.fp4.word_decode import mxfp4_scales_fold
    from kdaserve.ops.moe.fused import moe_experts_fused

    x, w13, w2, weights, ids = _gpu_step(scheme.removesuffix("-wide"), T, 64, seed_w=T, seed_x=T)
    if scheme.endswith("wide"):
        shift = 130 - min(int(w13.scale.min()), int(w2.scale.min()))
        w13, w2 = (Fp4Weights(w.packed, (w.scale + shift).contiguous(), None, 32).with_aligned_scales() for w in (w13, w2))
        x = x * 2.0**-shift
    if scheme.startswith("mxfp4"):
        assert mxfp4_scales_fold(w13.scale, w2.scale) == (scheme == "mxfp4")
    for left in (False, True):
        outs = {words: (moe_experts_fused(x, w13, w2, weights, ids, fp4_left=left, fp4_words=words),
                        fp4_linear(x, w13[3], fp4_left=left, fp4_words=words)) for words in (False, True)}
        assert torch.isfinite(outs[True][0]).all() and torch.isfinite(outs[True][1]).all()
        assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1]), left


@triton.jit
def _words_every_code_kernel(words_ptr, codes_ptr, out_ptr, GROUP: tl.constexpr, WIDE: tl.constexpr,
                             R: tl.constexpr, W: tl.constexpr):
    """out[c, 8 w + 2 b + h] = nibble h of byte b of word w times scale code c's factor, by the words
    program (R codes a program, the same W words for each)."""
    c = tl.program_id(0) * R + tl.arange(0, R)
    codes = tl.load(codes_ptr + c)
    pairs = mxfp4_scale_pair(codes, WIDE) if GROUP == 32 else nvfp4_scale_pair(codes)
    words = tl.load(words_ptr.to(tl.pointer_type(tl.uint32)) + tl.arange(0, W))
    tile_words = tl.broadcast_to(words[None, :], (R, W))
    tile_pairs = tl.broadcast_to(pairs[:, None], (R, W))
    out = e2m1_words_bf16(tile_words, tile_pairs, WIDE)
    tl.store(out_ptr + c[:, None] * (8 * W) + tl.arange(0, 8 * W)[None, :], out)


def _every_byte_in_every_position() -> torch.Tensor:
    """256 words (uint8 [256, 4], little-endian) whose bytes are every byte in each of the 4 positions."""
    return torch.tensor([_word_bytes(first) for first in range(256)], dtype=torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp4-wide", "nvfp4"])
def test_gpu_the_words_program_gives_every_code_times_every_scale_exactly(scheme):
    """The words programs on the GPU itself (prmt, and, mul.lo and fma.rn.bf16x2 as the hardware runs
    them, bf16 subnormals included: code 1's 2^-127 placement, e8m0's 2^-127, e4m3's subnormals), over
    every scale code each program takes (MXFP4 codes up to 128 folded, every code but NaN's 255 WIDE;
    NVFP4 every unsigned e4m3 code but NaN) and every byte in each position of a word: each byte's two
    values times the scale (NVFP4's times 2^-16), exactly."""
    from kdaserve.ops.fp4.word_decode import MXFP4_FOLDED_MAX_CODE, NVFP4_WORD_SHIFT

    group, wide = (16, False) if scheme == "nvfp4" else (32, scheme.endswith("wide"))
    words = _every_byte_in_every_position()
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.full((256, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
    _words_every_code_kernel[(64,)](words.view(torch.int32).cuda(), codes.cuda(), out, GROUP=group, WIDE=wide, R=4,
                                    W=256)
    bytes_k = words.reshape(-1).long()   # byte b of word w at 4 w + b: values 8 w + 2 b (low nibble), + 1 (high)
    values = e2m1_values()[torch.stack([bytes_k & 0xF, bytes_k >> 4], -1)].reshape(-1)
    if group == 32:   # 255 is NaN; the top codes overflow to inf times 4 and 6, in fp32 and bf16 alike
        usable = codes <= (254 if wide else MXFP4_FOLDED_MAX_CODE)
        factors = torch.exp2(codes.double() - 127).float()
    else:
        usable, factors = codes < 0x7F, (_e4m3_values(codes) * 2.0**-NVFP4_WORD_SHIFT).float()
    want = (factors[:, None] * values[None, :])[usable]
    assert torch.equal(want.bfloat16().float(), want), "every product is exact in bf16 (or inf in both)"
    assert torch.equal(out.cpu()[usable].float(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gpu_mxfp4_experts_through_dot_scaled_follow_the_decoding_path(T):
    """MXFP4 experts through tl.dot_scaled (the path of sm_100 and gfx950, where the tensor cores take
    e2m1 with e8m0 scales; forced here, Triton decomposing it where they do not): the fp32
    reference's result within bf16's rounding, and the register-decoding path's within the same.
    A swapped nibble order or a scale misread would be far outside it."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    E, k, hidden, inter = 256, 8, 2304, 1024
    w13, w2 = fp4_experts(E, hidden, inter, "mxfp4", device="cuda", seed=T + 1)
    g = torch.Generator(device="cuda").manual_seed(T + 1)
    x = torch.randn(T, hidden, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, hidden, device="cuda", generator=g) * hidden**-0.5
    weights, ids = route_tokens(x, gate, None, RouterConfig(E, k, routed_scaling_factor=2.446))
    scaled = moe_experts_fused(x, w13, w2, weights, ids, fp4_dots=True).float()
    decoded = moe_experts_fused(x, w13, w2, weights, ids, fp4_dots=False).float()
    want = moe_experts_reference(x.float(), w13, w2, weights, ids)
    assert_rel_close(scaled, want, 1e-2, f"MXFP4 through dot_scaled T={T}")
    assert_rel_close(scaled, decoded, 1e-2, f"dot_scaled against the decoding path T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 4096])
def test_gpu_mxfp4_linear_through_dot_scaled(M):
    """The 4-bit linear's tl.dot_scaled path (forced) at a GLM shared expert's gate|up: the fp32
    definition within bf16's rounding, and the decoding path's."""
    import torch.nn.functional as F

    from kdaserve.ops.fp4.linear import fp4_linear

    g = torch.Generator(device="cuda").manual_seed(M + 3)
    w = fp4_stack(torch.randn(1, 4096, 6144, device="cuda", generator=g) * 6144**-0.5, "mxfp4")[0]
    x = torch.randn(M, 6144, device="cuda", generator=g).bfloat16()
    scaled = fp4_linear(x, w, fp4_dots=True).float()
    assert_rel_close(scaled, F.linear(x.float(), w.dequantized(torch.float32)), 1e-2, f"dot_scaled linear M={M}")
    assert_rel_close(scaled, fp4_linear(x, w, fp4_dots=False).float(), 1e-2, f"against the decoding path M={M}")


def test_the_targets_that_multiply_fp4_natively_take_dot_scaled():
    from kdaserve.ops.precision import native_fp4_dots

    assert [t for t in ("sm_89", "sm_90", "sm_100", "sm_103", "gfx942", "gfx950", "cpu") if native_fp4_dots(t)] == [
        "sm_100", "sm_103", "gfx950"]
