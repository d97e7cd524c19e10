"""MLA kernels (kdaserve/ops/mla) against the torch reference: the absorbed decode over the paged
latent cache and the varlen causal prefill. CPU: the interpreter in fp32 at small sizes; GPU: bf16
at Kimi-Linear's sizes (latent 512 + 64, nope 128, v 128, 32 heads)."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.ops.mla import mla_decode_reference, mla_prefill_reference
from kdaserve.testing.compare import assert_rel_close

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


def decode_case(device, dtype, *, B_lens=(1, 17, 70, 5, 128, 33), H=3, L=32, R=16, BS=16, seed=0):
    """Rows with contexts over scattered blocks; the null block 0 is zero, the trash block (last)
    NaN, unused rows of a row's last block finite junk, and a padding row (null block, length 1)."""
    g = torch.Generator().manual_seed(seed)
    lens = list(B_lens) + [1]
    width = max(-(-n // BS) for n in lens)
    NB = sum(-(-n // BS) for n in lens) + 3
    cache = torch.randn(NB, BS, L + R, generator=g) * 2
    cache[0] = 0
    cache[NB - 1] = float("nan")
    free = (torch.randperm(NB - 2, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens[:-1]):
        for j in range(-(-n // BS)):
            tables[b, j] = free.pop()
    q_lat = torch.randn(len(lens), H, L, generator=g)
    q_pe = torch.randn(len(lens), H, R, generator=g)
    to = dict(device=device, dtype=dtype)
    return (q_lat.to(**to), q_pe.to(**to), cache.to(**to), tables.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def prefill_case(device, dtype, query_lens, context_lens, *, H=3, DN=16, R=16, DV=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, C = sum(query_lens), sum(context_lens)
    to = dict(device=device, dtype=dtype)
    return (torch.randn(T, H, DN, generator=g).to(**to), torch.randn(T, H, R, generator=g).to(**to),
            torch.randn(C, H, DN, generator=g).to(**to), torch.randn(C, R, generator=g).to(**to),
            torch.randn(C, H, DV, generator=g).to(**to))


def test_decode_reference_equals_the_expanded_form():
    """The absorbed decode (latent scores, latent output) is the same attention as expanding the
    latent with kv_b_proj into per-head keys and values."""
    g = torch.Generator().manual_seed(1)
    H, L, R, DN, DV, n = 2, 16, 8, 8, 12, 9
    w_kb = torch.randn(H, DN + DV, L, generator=g, dtype=torch.float64)
    latent, pe = torch.randn(n, L, generator=g, dtype=torch.float64), torch.randn(n, R, generator=g, dtype=torch.float64)
    q_nope, q_pe = torch.randn(1, H, DN, generator=g, dtype=torch.float64), torch.randn(1, H, R, generator=g, dtype=torch.float64)
    cache = torch.cat([latent, pe], -1).view(1, n, L + R)
    q_lat = torch.einsum("bhd,hdl->bhl", q_nope, w_kb[:, :DN])
    out_lat = mla_decode_reference(q_lat, q_pe, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n]), 0.3)
    absorbed = torch.einsum("bhl,hdl->bhd", out_lat, w_kb[:, DN:])
    kv = torch.einsum("tl,hdl->thd", latent, w_kb)
    expanded = mla_prefill_reference(q_nope, q_pe, kv[..., :DN], pe, kv[..., DN:], [1], [n], 0.3)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)


@INTERP
@pytest.mark.parametrize("R", [16, 0], ids=["rope", "no-rope"])
def test_decode_kernel_matches_the_reference_in_the_interpreter(R):
    from kdaserve.ops.mla.decode import mla_decode_triton

    case = decode_case("cpu", torch.float32, R=R)
    got = mla_decode_triton(*case, scale=0.2)
    want = mla_decode_reference(*case, scale=0.2)
    assert_rel_close(got, want, 1e-5, "MLA decode")


@INTERP
@pytest.mark.parametrize("splits", [2, 3, 9], ids=lambda n: f"{n}-splits")
def test_split_context_decode_matches_the_reference_in_the_interpreter(splits):
    """Flash decoding: each row's tiles divided among `splits` programs, merged by their log-sum-exp.
    9 splits of 32-token tiles leave most splits of the short rows empty (the padding row's 1 token,
    the 5-token row); heads (3) not a multiple of the group (16)."""
    from kdaserve.ops.mla.decode import mla_decode_triton

    case = decode_case("cpu", torch.float32, B_lens=(1, 17, 70, 5, 300, 33))
    got = mla_decode_triton(*case, scale=0.2, num_splits=splits)
    want = mla_decode_reference(*case, scale=0.2)
    assert_rel_close(got, want, 1e-5, f"MLA decode, {splits} splits")


def test_splits_are_chosen_from_shapes_alone():
    """Few rows over long tables split (as many as fit one wave of two programs per multiprocessor),
    many rows or short tables do not, and the count never exceeds the table's tiles / MIN_SPLIT_TILES or MAX_SPLITS."""
    from kdaserve.ops.mla.decode import MAX_SPLITS, choose_splits

    gpu = torch.device("cpu")   # planned as for 132 multiprocessors
    assert choose_splits(gpu, 1, 2, 8192, 32) == MAX_SPLITS
    assert choose_splits(gpu, 8, 2, 8192, 32) == 16   # 8 x 2 x 16 = 256 programs: one wave of 2 x 132
    assert choose_splits(gpu, 256, 2, 8192, 32) == 1
    assert choose_splits(gpu, 1, 2, 256, 32) == 2
    assert choose_splits(gpu, 1, 2, 64, 32) == 1


@INTERP
@pytest.mark.parametrize("query_lens, context_lens", [([5, 1, 20], [5, 9, 33]), ([1], [1]), ([17, 3], [17, 40])],
                         ids=["mixed", "one-token", "later-chunks"])
@pytest.mark.parametrize("R", [16, 0], ids=["rope", "no-rope"])
def test_prefill_kernel_matches_the_reference_in_the_interpreter(query_lens, context_lens, R):
    """R = 0: no rotary key part (GLM-5.3-Flash), the kernel skips that dot."""
    from kdaserve.ops.mla.prefill import mla_prefill_triton

    case = prefill_case("cpu", torch.float32, query_lens, context_lens, R=R)
    got = mla_prefill_triton(*case, query_lens, context_lens, 0.25)
    want = mla_prefill_reference(*case, query_lens, context_lens, 0.25)
    assert_rel_close(got, want, 1e-5, "MLA prefill")


def test_bad_shapes_say_what_is_needed():
    from kdaserve.ops.mla.decode import mla_decode_triton
    from kdaserve.ops.mla.prefill import mla_prefill_triton

    q_lat, q_pe, cache, tables, lens = decode_case("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"L\+R = 48"):
        mla_decode_triton(q_lat, q_pe, cache[..., :40].contiguous(), tables, lens, 0.1)
    case = prefill_case("cpu", torch.float32, [4], [4], DV=24)
    with pytest.raises(ValueError, match="power-of-two v_head_dim >= 16, got 24"):
        mla_prefill_triton(*case, [4], [4], 0.1)
    case = prefill_case("cpu", torch.float32, [4], [4], R=8)
    with pytest.raises(ValueError, match="power-of-two qk_rope_head_dim >= 16 or 0, got 8"):
        mla_prefill_triton(*case, [4], [4], 0.1)
    q_lat, q_pe, cache, tables, lens = decode_case("cpu", torch.float32, R=8)
    with pytest.raises(ValueError, match=r"MLA decode needs a power-of-two kv_lora_rank >= 16 \(got 32\) and a rope key "
                                         r"part of 0 or a power of two >= 16 \(got 8\)"):
        mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.1)
    case = prefill_case("cpu", torch.float32, [4], [3])
    with pytest.raises(ValueError, match="every context must hold its queries"):
        mla_prefill_triton(*case, [4], [3], 0.1)



def test_prefill_says_when_a_step_has_more_query_blocks_than_the_grid_holds(monkeypatch):
    import kdaserve.ops.mla.prefill as prefill

    monkeypatch.setattr(prefill, "MAX_QUERY_BLOCKS", 2)   # the real cap (65535) needs millions of tokens
    case = prefill_case("cpu", torch.float32, [40, 20], [40, 20])
    with pytest.raises(ValueError, match=r"at most 2 blocks of 16 queries in one call .* got 5 for 60 tokens"):
        prefill.mla_prefill_triton(*case, [40, 20], [40, 20], 0.1)

# (heads, latent, rope part, nope, v): Kimi-Linear-48B and GLM-5.3-Flash (no rotary part, 256-wide heads).
SIZES = {"kimi": (32, 512, 64, 128, 128), "glm": (64, 512, 0, 256, 256)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", SIZES)
def test_gpu_decode_at_real_sizes(model):
    from kdaserve.ops.mla.decode import mla_decode_triton

    H, L, R, DN, _ = SIZES[model]
    lens = (1, 17, 700, 5, 4096, 333, 2048, 64)
    case = decode_case("cuda", torch.bfloat16, B_lens=lens, H=H, L=L, R=R, BS=16)
    want = mla_decode_reference(*(t.float() if t.is_floating_point() else t for t in case), scale=(DN + R) ** -0.5)
    for splits in (None, 1, 7):   # the chosen count (8 rows: split), one launch, a count that leaves splits empty
        got = mla_decode_triton(*case, scale=(DN + R) ** -0.5, num_splits=splits)
        assert_rel_close(got.float(), want, 1e-2, f"MLA decode bf16, splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("model", SIZES)
def test_gpu_prefill_at_real_sizes(model):
    from kdaserve.ops.mla.prefill import mla_prefill_triton

    H, _, R, DN, DV = SIZES[model]
    q_lens, c_lens = [1000, 1, 300, 2048], [1000, 77, 1500, 2048]
    case = prefill_case("cuda", torch.bfloat16, q_lens, c_lens, H=H, DN=DN, R=R, DV=DV)
    got = mla_prefill_triton(*case, q_lens, c_lens, (DN + R) ** -0.5)
    want = mla_prefill_reference(*(t.float() for t in case), q_lens, c_lens, (DN + R) ** -0.5)
    assert_rel_close(got.float(), want, 1e-2, "MLA prefill bf16")


def test_mla_and_moe_kernels_compile_for_sm90_without_spills():
    """tools/compile_check.py at Kimi-Linear's serving shapes, as the kernels are launched."""
    from compiled_mode import run_compiled

    out = run_compiled(["-m", "tools.compile_check", "--arch", "sm_90", "--kernels", "mla,moe"], timeout=600)
    assert "mla decode" in out and "moe down prefill" in out
