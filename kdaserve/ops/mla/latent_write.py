"""The MLA cache write of a step's new tokens, with the latent's RMSNorm, in one launch:

    cache[slot[t], :L]    = round(norm(kv[t, :L]) * weight)     kv_a_layernorm (fp32 math)
    cache[slot[t], L:L+R] = kv[t, L:]                           the key's rotary part, as it is

the definition is layers/mla.MLAttention's torch path (kv_a_layernorm on the latent, the
concatenation with k_pe, its cast to the cache's dtype and the index copy into the flat cache
rows): four to five launches there, one here (Kimi-Linear: seven MLA layers per decode step).

One program per token; kv's rows may be strided (the projection's output), the last dim contiguous.
CUDA-graph padding rows all write the trash row: same values, in any order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat


@triton.jit
def mla_latent_write_kernel(kv_ptr, stride_kv, w_ptr, cache_ptr, slots_ptr, L, R, eps,
                            BL: tl.constexpr, BR: tl.constexpr, HAS_PE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = cache_ptr + tl.load(slots_ptr + t).to(tl.int64) * (L + R)
    cols = tl.arange(0, BL)
    ok = cols < L
    x = tl.load(kv_ptr + t * stride_kv + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / L + eps)
    y = x * rstd * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # Rounded to the projection's dtype first, as the torch path's norm output, then to the cache's.
    tl.store(row + cols, y.to(kv_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty), mask=ok)
    if HAS_PE:
        pe = tl.arange(0, BR)
        pe_ok = pe < R
        k_pe = tl.load(kv_ptr + t * stride_kv + L + pe, mask=pe_ok, other=0.0)
        tl.store(row + L + pe, k_pe.to(cache_ptr.dtype.element_ty), mask=pe_ok)


def mla_latent_write(kv: torch.Tensor, weight: torch.Tensor, eps: float, cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """kv [T, L + R] (kv_a_proj_with_mqa's output), weight [L] (kv_a_layernorm's), cache
    [blocks, block_size, L + R], slot_mapping [T] flat cache rows: writes the T rows in place."""
    T, width = kv.shape
    L = weight.shape[0]
    R = width - L
    if R < 0 or cache.shape[-1] != width or slot_mapping.shape != (T,):
        raise ValueError(f"MLA cache write needs kv [T, L + R], weight [L], cache [.., .., L + R] and slot_mapping [T]; "
                         f"got kv {list(kv.shape)}, weight {list(weight.shape)}, cache {list(cache.shape)}, "
                         f"slot_mapping {list(slot_mapping.shape)}")
    if T == 0:
        return
    interpreter_compat.install()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    BL = triton.next_power_of_2(L)
    mla_latent_write_kernel[(T,)](
        kv, kv.stride(0), weight if weight.stride(0) == 1 else weight.contiguous(), cache, slot_mapping, L, R, eps,
        BL=BL, BR=triton.next_power_of_2(max(R, 1)), HAS_PE=R > 0, num_warps=4 if BL <= 1024 else 8,
    )
