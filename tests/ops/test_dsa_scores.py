"""The DSA index-score kernel (ops/dsa/triton_scores.py) against the torch reference on fresh random
inputs: fp32 and fp16, decode-like (one query per row, several rows) and prefill-like (many queries,
pool counts that are not multiples of the block), outputs NaN-filled first; the selection built on
it equals the reference's; compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from kdaserve.ops.dsa.reference import dsa_index_scores_reference, dsa_pool_keys, dsa_select_reference
from kdaserve.ops.dsa.triton_scores import dsa_index_scores_triton


@pytest.fixture(autouse=True)
def _interpret(request):
    import triton

    if "sm90" not in request.node.name and not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")


def _inputs(B, n, C, H, Di, kpool, dtype, g):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(B, n, H, Di, generator=g).to(dtype)
    w = torch.randn(B, n, H, generator=g) * H**-0.5
    keys = torch.randn(B, C, Di, generator=g).to(dtype)
    gates = torch.randn(B, C, Di, generator=g).to(dtype)
    ape = torch.randn(kpool, Di, generator=g).to(dtype)
    positions = torch.stack([torch.sort(torch.randperm(C, generator=g)[:n]).values for _ in range(B)])
    return [t.to(device) for t in (q, w, keys, gates, ape, positions)]


@pytest.mark.parametrize("B, n, C, H, Di, dtype", [(3, 1, 200, 4, 16, torch.float32), (1, 40, 300, 8, 32, torch.float32),
                                                   (2, 20, 130, 4, 16, torch.float16)])
def test_index_scores_match_the_reference(B, n, C, H, Di, dtype):
    g = torch.Generator().manual_seed(B * 100 + n)
    kpool = 4
    q, w, keys, gates, ape, positions = _inputs(B, n, C, H, Di, kpool, dtype, g)
    pool_keys = dsa_pool_keys(keys, gates, ape, kpool)
    ref = dsa_index_scores_reference(q, w, pool_keys, positions, kpool)
    import kdaserve.ops.dsa.triton_scores as ts

    real_empty = torch.empty
    try:   # NaN-fill the output the kernel must write completely
        ts.torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        got = dsa_index_scores_triton(q, w, pool_keys, positions, kpool)
    finally:
        ts.torch.empty = real_empty
    assert not got.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, ref, **tol)
    allowed_ref = dsa_select_reference(q, w, keys, gates, ape, positions, topk=16, kpool=kpool)
    allowed = dsa_select_reference(q, w, keys, gates, ape, positions, topk=16, kpool=kpool, scores=dsa_index_scores_triton)
    if dtype == torch.float32:
        assert torch.equal(allowed, allowed_ref)


def test_a_head_dim_the_kernel_cannot_take_is_refused():
    with pytest.raises(ValueError, match="power-of-two index_head_dim"):
        dsa_index_scores_triton(torch.zeros(1, 1, 2, 24), torch.zeros(1, 1, 2), torch.zeros(1, 3, 24),
                                torch.zeros(1, 1, dtype=torch.long), 4)


_SM90 = '''
import re
from kdaserve.ops.dsa.triton_scores import dsa_index_scores_kernel
from tools.sm90_compile import compile_for_sm90, ptxas_report
types = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*bf16", pos_ptr="*i64", out_ptr="*fp32", n="i32", P="i32", H="i32",
             kpool="i32", scale="fp32", s_qb="i64", s_qn="i64", s_qh="i64", s_wb="i64", s_wn="i64", s_kb="i64",
             s_kp="i64", s_pb="i64", s_ob="i64", s_on="i64")
for BM in (16, 64):
    r = ptxas_report(compile_for_sm90(dsa_index_scores_kernel, types, dict(DI=128, BM=BM, BP=64, IEEE=False)))
    assert re.match(r"regs=\\d+ spill_st=0 ", r), r
    print(BM, r)
print("ok")
'''


def test_the_kernel_compiles_for_sm90(tmp_path):
    """GLM's index heads (128 wide), bf16, both query blocks: ptxas without spills."""
    from compiled_mode import run_compiled

    script = tmp_path / "dsa_sm90.py"
    script.write_text(_SM90)
    print(run_compiled([str(script)], timeout=300))
