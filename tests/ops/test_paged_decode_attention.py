"""The Triton paged decode attention kernel against the torch form (interpreter on the CPU, fp32;
bf16 on the GPU)."""

import os

import pytest
import torch

from kdaserve.layers.attention import decode_attention_torch


def _case(device, dtype, Hq=8, Hkv=2, D=16, BS=16, NB=24, seed=0):
    """Rows with contexts of 1..128 tokens over scattered blocks; the null block is zero, the
    trash block NaN, and the unused tail of each row's last block holds finite junk."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, BS, Hkv, D, generator=g) * 3
    v = torch.randn(NB, BS, Hkv, D, generator=g) * 3
    k[0] = v[0] = 0
    k[NB - 1] = v[NB - 1] = float("nan")
    lens = [1, 17, 70, 5, 128, 1]
    width = 8
    free = (torch.randperm(NB - 2, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens[:-1]):               # the last row is padding: null block, length 1
        for j in range(-(-n // BS)):
            tables[b, j] = free.pop()
    q = torch.randn(len(lens), Hq, D, generator=g)
    to = dict(device=device, dtype=dtype)
    return q.to(**to), k.to(**to), v.to(**to), tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
def test_kernel_matches_torch_in_the_interpreter():
    from kdaserve.ops.attention.paged_decode import paged_decode_attention_triton

    q, k, v, tables, lens = _case("cpu", torch.float32)
    got = paged_decode_attention_triton(q, k, v, tables, lens, 0.3)
    want = decode_attention_torch(q, k, v, tables, lens, 0.3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("D, Hq, Hkv", [(128, 16, 4), (64, 8, 8), (16, 4, 2)])
def test_kernel_matches_torch_on_gpu(D, Hq, Hkv):
    from kdaserve.ops.attention.paged_decode import paged_decode_attention_triton

    q, k, v, tables, lens = _case("cuda", torch.bfloat16, Hq=Hq, Hkv=Hkv, D=D)
    got = paged_decode_attention_triton(q, k, v, tables, lens, D**-0.5)
    want = decode_attention_torch(q.float(), k.float(), v.float(), tables, lens, D**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
