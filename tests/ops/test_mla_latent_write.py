"""The MLA cache write in one launch (ops/mla/latent_write.py) against layers/mla.MLAttention's torch
path, its definition (kv_a_layernorm of the latent, the key's rotary part beside it, cast to the
cache's dtype, index-copied into the flat cache rows): the written rows equal it, every other row
of a NaN-filled cache stays bit for bit as it was, with a rotary part (Kimi-Linear) and without
(GLM-5.3-Flash), strided projection rows, and padding rows that all write the trash row."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.layers.mla import MLAttention
from kdaserve.ops.mla.latent_write import mla_latent_write
from kdaserve.testing.compare import assert_rel_close, assert_slots_untouched, nan_poison

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


def _layer(L: int, R: int, backend: str, dtype=torch.float32, device="cpu") -> MLAttention:
    layer = MLAttention(32, 2, kv_lora_rank=L, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8, backend=backend,
                        dtype=dtype, device=device)
    layer.kv_a_layernorm.weight.copy_(torch.rand(L, device=device) + 0.5)
    return layer


def _written(layer: MLAttention, kv: torch.Tensor, slots: torch.Tensor, blocks: int = 6, bs: int = 4) -> torch.Tensor:
    cache = nan_poison(torch.empty(blocks, bs, layer.L + layer.R, dtype=kv.dtype, device=kv.device))
    layer.bind_cache(cache)
    before = cache.clone()
    layer._write_cache(kv, slots)
    assert_slots_untouched(before.view(-1, cache.shape[-1]), cache.view(-1, cache.shape[-1]), slots.tolist(), "MLA cache")
    return cache.view(-1, cache.shape[-1])


@INTERP
@pytest.mark.parametrize("L, R", [(32, 16), (48, 0), (20, 6)], ids=["kimi-like", "no-rotary-part", "odd-widths"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)], ids=["fp32", "fp16"])
def test_rows_equal_the_torch_path_and_nothing_else_moves(L, R, dtype, tol):
    kernel, torch_path = _layer(L, R, "triton"), _layer(L, R, "reference")
    torch_path.load_state_dict(kernel.state_dict())
    wide = (torch.randn(7, L + R + 5) * 3).to(dtype)
    kv = wide[:, 2 : 2 + L + R]   # a strided view, as a slice of a wider projection would be
    slots = torch.tensor([3, 17, 0, 9, 22, 5, 12])
    got, want = _written(kernel, kv, slots), _written(torch_path, kv, slots)
    assert_rel_close(got[slots, :L].float(), want[slots, :L].float(), tol, "normalized latent")
    assert torch.equal(got[slots, L:], want[slots, L:]), "the rotary part is copied as it is"
    assert torch.isfinite(got[slots]).all()


@INTERP
def test_padding_rows_write_only_the_trash_row():
    layer = _layer(16, 8, "triton")
    kv = torch.cat([torch.randn(3, 24), torch.zeros(5, 24)])   # 3 real rows, 5 graph-padding rows
    trash = 23
    slots = torch.tensor([1, 2, 7] + [trash] * 5)
    cache = _written(layer, kv, slots)
    assert torch.equal(cache[trash], torch.zeros(24))


def test_bad_shapes_say_what_is_needed():
    with pytest.raises(ValueError, match=r"kv \[T, L \+ R\].*got kv \[3, 24\], weight \[16\], cache \[2, 4, 20\]"):
        mla_latent_write(torch.randn(3, 24), torch.ones(16), 1e-6, torch.zeros(2, 4, 20), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"slot_mapping \[2\]"):
        mla_latent_write(torch.randn(3, 24), torch.ones(16), 1e-6, torch.zeros(2, 4, 24), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
def test_gpu_bf16_at_kimi_linear_sizes(T):
    kernel, torch_path = _layer(512, 64, "triton", torch.bfloat16, "cuda"), _layer(512, 64, "reference", torch.bfloat16, "cuda")
    torch_path.load_state_dict(kernel.state_dict())
    kv = torch.randn(T, 576, device="cuda").bfloat16()
    blocks = T // 16 + 2
    slots = torch.randperm(blocks * 16, device="cuda")[:T]
    got, want = _written(kernel, kv, slots, blocks, 16), _written(torch_path, kv, slots, blocks, 16)
    assert_rel_close(got[slots, :512].float(), want[slots, :512].float(), 4e-3, "normalized latent")
    assert torch.equal(got[slots, 512:], want[slots, 512:])
