"""Full attention: grouped-query attention with RoPE over a paged KV cache, in plain torch
(CPU and GPU). Correctness first; the decode part has fixed shapes so CUDA graphs can capture it.

The KV cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
The engine keeps two blocks out of circulation (see kdaserve/engine/caches.py): block 0, the null
block, which padding entries of block tables point at and nobody writes, and a trash block that
CUDA-graph padding rows write to and nobody reads. Masked positions are therefore always finite
(zeros or rows of earlier requests), so a zero attention weight never meets a NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.context import get_context
from kdaserve.layers.distributed import all_reduce, split, tensor_parallel
from kdaserve.layers.linear import MergedLinear
from kdaserve.layers.rotary import RotaryEmbedding


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V [T, Hkv, D] into their cache rows; graph-safe (no host data, fixed shapes)."""
    Hkv, D = k_cache.shape[-2:]
    k_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per row, q [B, Hq, D], over the first context_lens[b] cached tokens of its
    blocks: the Triton kernel on GPUs (cost follows the real context), else plain torch."""
    D = q.shape[-1]
    if q.is_cuda and D >= 16 and D & (D - 1) == 0:
        from kdaserve.ops.attention.paged_decode import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The torch form: gathers the whole block-table width (fixed shapes), masks past the context."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    keys = k_cache[block_tables].view(B, -1, Hkv, D)      # [B, L, Hkv, D]
    values = v_cache[block_tables].view(B, -1, Hkv, D)
    L = keys.shape[1]
    visible = torch.arange(L, device=q.device)[None, :] < context_lens[:, None]   # [B, L]
    # Masked positions may hold anything (stale rows, padding writes, even NaN): zero them so a
    # zero weight times garbage can never reach the output.
    values = torch.where(visible[:, :, None, None], values, values.new_zeros(()))
    scores = torch.einsum("bhgd,blhd->bhgl", q.view(B, Hkv, G, D).float(), keys.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, values.float())
    return out.reshape(B, Hq, D).to(q.dtype)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each prefill sequence's new tokens over its whole cached context
    (earlier chunks included). q [Tp, Hq, D]; lengths come from host lists (no sync)."""
    Hq, D = q.shape[1:]
    Hkv = k_cache.shape[2]
    k_rows, v_rows = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    out = torch.empty_like(q)
    q_off = kv_off = 0
    for n, ctx in zip(md.prefill_query_lens, md.prefill_context_lens):
        rows = md.prefill_kv_rows[kv_off : kv_off + ctx]
        k = k_rows[rows].to(q.dtype).repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)   # [Hq, ctx, D]
        v = v_rows[rows].to(q.dtype).repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
        qs = q[q_off : q_off + n].transpose(0, 1)                                           # [Hq, n, D]
        if n == ctx:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        else:  # a later chunk: query i sits at position ctx-n+i
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[q_off : q_off + n] = o.transpose(0, 1)
        q_off, kv_off = q_off + n, kv_off + ctx
    return out


def paged_attention(q, k, v, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's K/V, then attend: the decode rows (a fixed-shape prefix) and the prefill rows."""
    store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    nd = md.num_decode_tokens
    if nd == q.shape[0]:
        return decode_attention(q, k_cache, v_cache, md.decode_block_tables, md.decode_context_lens, scale)
    if nd == 0:
        return prefill_attention(q, k_cache, v_cache, md, scale)
    return torch.cat([
        decode_attention(q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_context_lens, scale),
        prefill_attention(q[nd:], k_cache, v_cache, md, scale),
    ])


class FullAttention(nn.Module):
    """A full-attention layer: merged q|k|v projection, RoPE, paged attention, output projection.
    `k_cache`/`v_cache` are bound by the engine; with no metadata (dummy runs) it only projects."""

    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
        rope_theta: float, max_position: int, rotary_dim: int | None = None, bias: bool = False,
        layer_idx: int = 0, dtype=None, device=None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        # This rank's heads (tensor parallel: q, k, v column-parallel by heads, o_proj row-parallel).
        num_heads, num_kv_heads = split(num_heads, "num_attention_heads"), split(num_kv_heads, "num_key_value_heads")
        self.tp = tensor_parallel()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx, self.scale = layer_idx, head_dim**-0.5
        self.qkv_proj = MergedLinear(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=bias, dtype=dtype, device=device,
        )
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, dtype=dtype, device=device)
        self.o_proj.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(head_dim, rotary_dim or head_dim, max_position, rope_theta, device=device)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The cache tensors the engine allocates and binds (K, then V)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [shape, shape]

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        T = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        md = get_context().attn
        if md is None or self.k_cache is None:
            # Dummy run: attend within the step as one causal sequence so shapes and costs are real.
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(self.num_heads // self.num_kv_heads, 1).transpose(0, 1),
                v.repeat_interleave(self.num_heads // self.num_kv_heads, 1).transpose(0, 1), is_causal=True,
            ).transpose(0, 1)
        else:
            o = paged_attention(q, k, v, self.k_cache, self.v_cache, md, self.scale)
        return all_reduce(self.o_proj(o.reshape(T, q_size)), self.tp)
