"""Sparse MLA decode (ops/mla/sparse_decode.py) against the masked reference on fresh random inputs
(interpreter on the CPU: fp32 and fp16, with and without a rotary key part, -1 padding anywhere in
the chosen positions, a first tile with nothing chosen, output NaN-filled first); DSA's choice as
positions equals its choice as a mask; compiled for sm_90 at GLM's shape."""

from __future__ import annotations

import pytest
import torch

from kdaserve.ops.dsa.reference import dsa_choose, dsa_choose_indices
from kdaserve.ops.mla.reference import mla_decode_reference
from kdaserve.ops.mla.sparse_decode import mla_sparse_decode_triton


@pytest.fixture(autouse=True)
def _interpret(request):
    import triton

    if "sm90" not in request.node.name and not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")


def _mask(idx: torch.Tensor, C: int) -> torch.Tensor:
    mask = torch.zeros(*idx.shape[:-1], C + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(idx >= 0, idx.long(), C), True)
    return mask[..., :C]


@pytest.mark.parametrize("R, dtype", [(0, torch.float32), (16, torch.float32), (0, torch.float16)])
def test_sparse_decode_matches_the_masked_reference(R, dtype):
    g = torch.Generator().manual_seed(R + 7)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, L, BS, width = 3, 4, 32, 4, 20
    cache = torch.randn(1 + B * width, BS, L + R, generator=g).to(dtype)
    tables = (torch.randperm(B * width, generator=g) + 1).view(B, width).to(torch.int32)
    ctx = torch.tensor([70, 9, 80])
    K = 48
    idx = torch.full((B, K), -1, dtype=torch.int32)
    for b in range(B):
        chosen = torch.randperm(int(ctx[b]), generator=g)[: K - 8]
        slots = torch.randperm(K, generator=g)[: chosen.numel()]
        idx[b, slots] = chosen.to(torch.int32)
    idx[1, :32] = -1                      # a whole first tile with nothing chosen
    idx[1, 40] = 3
    q_latent = torch.randn(B, H, L, generator=g).to(dtype)
    q_pe = torch.randn(B, H, R, generator=g).to(dtype)
    cache, tables, idx, q_latent, q_pe = (t.to(device) for t in (cache, tables, idx, q_latent, q_pe))
    import kdaserve.ops.mla.sparse_decode as sd

    real_empty = torch.empty
    try:
        sd.torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        got = mla_sparse_decode_triton(q_latent, q_pe, cache, tables, idx, L**-0.5)
    finally:
        sd.torch.empty = real_empty
    allowed = _mask(idx, width * BS)
    ref = mla_decode_reference(q_latent, q_pe, cache, tables, ctx.to(device).to(torch.int32), L**-0.5, allowed)
    assert not got.isnan().any()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_sizes_the_kernel_cannot_take_are_refused():
    cache = torch.zeros(2, 4, 24 + 8)
    with pytest.raises(ValueError, match=r"sparse MLA decode needs a power-of-two kv_lora_rank >= 16 \(got 24\) and a "
                                         r"rope key part of 0 or a power of two >= 16 \(got 8\)"):
        mla_sparse_decode_triton(torch.zeros(1, 2, 24), torch.zeros(1, 2, 8), cache, torch.zeros(1, 2, dtype=torch.int32),
                                 torch.zeros(1, 3, dtype=torch.int32), 1.0)


def test_the_choice_as_positions_equals_the_choice_as_a_mask():
    g = torch.Generator().manual_seed(1)
    B, n, C, kpool, topk = 2, 6, 90, 4, 16
    P = C // kpool
    index = torch.randn(B, n, P, generator=g)
    positions = torch.stack([torch.sort(torch.randperm(C, generator=g)[:n]).values for _ in range(B)])
    ends = torch.arange(P) * kpool + kpool - 1
    index = index.masked_fill(ends[None, None] > positions[..., None], torch.finfo(torch.float32).min)
    mask = dsa_choose(index, positions, C, topk=topk, kpool=kpool, always_select_tail=True)
    idx = dsa_choose_indices(index, positions, topk=topk, kpool=kpool, always_select_tail=True)
    assert idx.shape == (B, n, topk + kpool - 1) and idx.dtype == torch.int32
    assert torch.equal(_mask(idx, C), mask)


_SM90 = '''
import re
from kdaserve.ops.mla.sparse_decode import _mla_sparse_decode_kernel
from tools.sm90_compile import compile_for_sm90, ptxas_report
types = dict(ql_ptr="*bf16", qp_ptr="*bf16", cache_ptr="*bf16", tables_ptr="*i32", idx_ptr="*i32", out_ptr="*bf16",
             scale="fp32", K="i32", stride_qlb="i64", stride_qlh="i64", stride_qpb="i64", stride_qph="i64",
             stride_ob="i64", stride_oh="i64", stride_tb="i64", stride_ib="i64", stride_row="i64")
r = ptxas_report(compile_for_sm90(_mla_sparse_decode_kernel, types, dict(H=64, L=512, R=16, HAS_PE=False, BLOCK_H=16,
                 BLOCK_SIZE=16, TILE=32, PREC="tf32"), num_warps=8))
assert re.match(r"regs=\\d+ spill_st=0 ", r), r
print(r)
print("ok")
'''


def test_the_kernel_compiles_for_sm90(tmp_path):
    """GLM's MLA (latent 512, no rotary part), bf16, 8 warps: ptxas without spills."""
    from compiled_mode import run_compiled

    script = tmp_path / "sparse_sm90.py"
    script.write_text(_SM90)
    print(run_compiled([str(script)], timeout=300))
