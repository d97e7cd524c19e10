"""Multi-head latent attention (DeepSeek-V2 style MLA) over a paged latent cache.

Projections, with the released checkpoint names:
    q          = q_proj(x)                          [T, H, Dn + R]   (or q_b_proj(norm(q_a_proj(x))) with q-LoRA)
    c | k_pe   = kv_a_proj_with_mqa(x)              [T, L + R]
    c          = kv_a_layernorm(c)                  the latent the cache keeps, with k_pe beside it
    k_nope | v = kv_b_proj(c)                       [T, H, Dn + Dv]  (prefill expands the context)
    scores     = (q_nope·k_nope + q_pe·k_pe) * (Dn + R)^-0.5, causal
    out        = o_proj(attention)
Kimi-Linear and GLM use no rotary embedding (`mla_use_nope`): q_pe and k_pe are used as they are.
With `rotary` (Ling-3: interleaved pairs, layers/rotary.py) q_pe and k_pe are rotated by position
first, and the cache keeps the rotated k_pe, so decode stays one latent read per token and the
kernels never see positions. With `head_gate` (Ling-3) each head's attention output is scaled by
sigmoid(g_proj(x)) [T, H] (fp32 sigmoid, in the activation dtype, as transformers) before o_proj.

Decode uses the absorbed form: with W_UK, W_UV the k_nope and v rows of kv_b_proj per head,
q_latent = q_nope W_UK and out = W_UV (softmax · c), so each cached token is read once as a latent,
never expanded. Both forms are views of kv_b_proj's weight: nothing derived to keep in sync.

The cache `[num_blocks, block_size, L + R]` is bound by the engine; block 0 is the null block and
the last block the trash block (engine/caches.py), as for grouped-query attention. The per-step
metadata is the attention layers' (layers/attention.AttentionMetadata)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.context import get_context
from kdaserve.layers.distributed import all_reduce, split, tensor_parallel
from kdaserve.layers.kernel_choice import resolve_kernel_choice
from kdaserve.layers.linear import make_linear
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.rotary import RotaryEmbedding
from kdaserve.ops.mla.reference import mla_decode_reference, mla_prefill_reference


@dataclass
class Selection:
    """Sparse attention's choice for one step: per decode row the context positions it may see
    ([rows, table width * block size] bool), per prefill sequence [query_len, context_len] bool."""

    decode: torch.Tensor | None
    prefill: list[torch.Tensor] | None
    # The decode rows' choice as context positions [rows, K] (-1: none), for the sparse kernel
    # (ops/mla/sparse_decode.py) instead of `decode`.
    decode_indices: torch.Tensor | None = None
    # The prefill queries' choice as flat cache rows [prefill tokens, K] (-1: none), for the same kernel.
    prefill_rows: torch.Tensor | None = None


def _linear(i: int, o: int, dtype, device, fp8_block: tuple[int, int] | None = None) -> nn.Module:
    return make_linear(i, o, dtype=dtype, device=device, fp8_block=fp8_block)


class MLAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, norm_eps: float = 1e-6,
                 layer_idx: int = 0, backend: str = "auto", dtype=None, device=None,
                 fp8_block: tuple[int, int] | None = None, rotary: RotaryEmbedding | None = None,
                 head_gate: bool = False):
        super().__init__()
        device = torch.device(device) if device is not None else torch.empty(0).device
        # This rank's heads (tensor parallel: q and kv_b by heads, o_proj row-parallel; the latent
        # projection, its norm and the latent cache whole on every rank, as vLLM keeps them).
        num_heads, self.tp = split(num_heads, "num_attention_heads"), tensor_parallel()
        self.num_heads, self.layer_idx = num_heads, layer_idx
        self.L, self.R, self.Dn, self.Dv = kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        self.q_lora_rank = q_lora_rank
        q_out = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = _linear(hidden_size, q_out, dtype, device, fp8_block)
        else:
            self.q_a_proj = _linear(hidden_size, q_lora_rank, dtype, device, fp8_block)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, dtype=dtype, device=device)
            self.q_b_proj = _linear(q_lora_rank, q_out, dtype, device, fp8_block)
        self.kv_a_proj_with_mqa = _linear(hidden_size, kv_lora_rank + qk_rope_head_dim, dtype, device, fp8_block)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, dtype=dtype, device=device)
        # kv_b_proj stays in `dtype` even from an FP8 checkpoint: decode reads it as the absorbed
        # W_UK, W_UV views.
        self.kv_b_proj = _linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), dtype, device)
        self.o_proj = _linear(num_heads * v_head_dim, hidden_size, dtype, device, fp8_block)
        if rotary is not None and rotary.head_dim != qk_rope_head_dim:
            raise ValueError(f"the rotary embedding rotates heads of {rotary.head_dim}, but q_pe / k_pe have "
                             f"qk_rope_head_dim = {qk_rope_head_dim}")
        self.rotary = rotary
        # The per-head output gate [H, hidden] (this rank's heads), kept in the activation dtype.
        self.g_proj = _linear(hidden_size, num_heads, dtype, device) if head_gate else None
        self.backend = resolve_kernel_choice("MLA", backend, device)
        self.cache: torch.Tensor | None = None

    # ---- cache ----------------------------------------------------------------------------------

    @property
    def cache_row_width(self) -> int:
        return self.L + self.R

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, self.L + self.R)]

    def bind_cache(self, cache: torch.Tensor) -> None:
        if cache.dim() != 3 or cache.shape[-1] != self.L + self.R:
            raise ValueError(f"MLA cache must be [num_blocks, block_size, {self.L + self.R}] (layer {self.layer_idx}), "
                             f"got {list(cache.shape)}")
        self.cache = cache

    # ---- forward --------------------------------------------------------------------------------

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, Dn, L], W_UV [H, Dv, L]): views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.Dn + self.Dv, self.L)
        return w[:, : self.Dn], w[:, self.Dn :]

    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor | None, md: AttentionMetadata) -> Selection | None:
        """Which context tokens each query attends to: None (all before it, causal); sparse
        variants (layers/dsa.py) override it."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        T, H = hidden.shape[0], self.num_heads
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q = q.view(T, H, self.Dn + self.R)
        q_nope, q_pe = q[..., : self.Dn], q[..., self.Dn :]
        kv = self.kv_a_proj_with_mqa(hidden)
        if self.rotary is not None:   # rotated before the cache write: the cache keeps rotated keys
            q_pe, k_pe = self.rotary(positions, q_pe, kv[:, None, self.L :])
            kv[:, self.L :] = k_pe[:, 0]
        md: AttentionMetadata | None = get_context().attn
        if md is None or self.cache is None:
            # Dummy run (memory profile): the step as one causal sequence, so shapes and costs are real.
            latent, k_pe = self.kv_a_layernorm(kv[:, : self.L].contiguous()), kv[:, self.L :]
            return self._output(self._prefill(q_nope, q_pe, latent, k_pe, [T], [T]), hidden)
        self._write_cache(kv, md.slot_mapping)
        selection = self.select(hidden, q_resid, md)
        nd = md.num_decode_tokens
        parts = []
        if nd:
            parts.append(self._decode(q_nope[:nd], q_pe[:nd], md, selection))
        if nd < T and selection is not None and selection.prefill_rows is not None:
            parts.append(self._sparse_prefill(q_nope[nd:], q_pe[nd:], selection.prefill_rows))
        elif nd < T:
            ctx = self.cache.view(-1, self.L + self.R)[md.prefill_kv_rows]
            parts.append(self._prefill(q_nope[nd:], q_pe[nd:], ctx[:, : self.L].to(hidden.dtype),
                                       ctx[:, self.L :].to(hidden.dtype), md.prefill_query_lens, md.prefill_context_lens,
                                       selection.prefill if selection else None))
        return self._output(parts[0] if len(parts) == 1 else torch.cat(parts), hidden)

    def _output(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' outputs o [T, H, Dv] (gated per head with `head_gate`) through o_proj; the
        ranks' partial sums added (tensor parallel)."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(hidden).float()).to(o.dtype).unsqueeze(-1)
        return all_reduce(self.o_proj(o.reshape(o.shape[0], self.num_heads * self.Dv)), self.tp)

    def _write_cache(self, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's new tokens into their cache rows: kv_a_layernorm(latent) | k_pe (the Triton
        backend in one launch, ops/mla/latent_write.py; the torch path is the definition)."""
        norm = self.kv_a_layernorm
        if self.backend == "triton":
            from kdaserve.ops.mla.latent_write import mla_latent_write

            mla_latent_write(kv, norm.weight, norm.eps, self.cache, slot_mapping)
            return
        rows = torch.cat([norm(kv[:, : self.L].contiguous()), kv[:, self.L :]], dim=-1).to(self.cache.dtype)
        self.cache.view(-1, self.L + self.R).index_copy_(0, slot_mapping, rows)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata,
                selection: Selection | None = None) -> torch.Tensor:
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("bhd,hdl->bhl", q_nope, w_uk)
        allowed = selection.decode if selection is not None else None
        if selection is not None and selection.decode_indices is not None:   # DSA: only the chosen rows
            from kdaserve.ops.mla.sparse_decode import mla_sparse_decode_triton

            out_latent = mla_sparse_decode_triton(q_latent, q_pe, self.cache, md.decode_block_tables,
                                                  selection.decode_indices, self.scale)
        elif self.backend == "triton" and allowed is None:
            from kdaserve.ops.mla.decode import mla_decode_triton

            out_latent = mla_decode_triton(q_latent, q_pe, self.cache, md.decode_block_tables, md.decode_context_lens, self.scale)
        else:
            out_latent = mla_decode_reference(q_latent.to(self.cache.dtype), q_pe.to(self.cache.dtype), self.cache,
                                              md.decode_block_tables, md.decode_context_lens, self.scale, allowed)
        return self._value_heads(out_latent.to(q_nope.dtype), w_uv)

    def _value_heads(self, out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """out_latent [rows, H, L] -> [rows, H, Dv] through each head's value rows, written
        row-major by the batched GEMM itself (its output is the per-head [rows, Dv] blocks of a
        [rows, H, Dv] tensor), so o_proj's reshape is a view: a head-major result would be copied."""
        o = torch.empty(out_latent.shape[0], self.num_heads, self.Dv, dtype=out_latent.dtype, device=out_latent.device)
        torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return o

    def _sparse_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each prefill query over its chosen cache rows only, absorbed like decode: the sparse
        kernel with one "row" per query whose block table is its chosen flat rows (block size 1)."""
        from kdaserve.ops.mla.sparse_decode import mla_sparse_decode_triton

        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("bhd,hdl->bhl", q_nope, w_uk)
        K = rows.shape[1]
        token_idx = torch.where(rows >= 0, torch.arange(K, device=rows.device, dtype=torch.int32), -1)
        out_latent = mla_sparse_decode_triton(q_latent, q_pe, self.cache.view(-1, 1, self.L + self.R),
                                              rows.clamp_min(0).to(torch.int32), token_idx, self.scale)
        return self._value_heads(out_latent.to(q_nope.dtype), w_uv)

    def _prefill(self, q_nope, q_pe, ctx_latent, ctx_pe, query_lens: list[int], context_lens: list[int],
                 allowed: list[torch.Tensor] | None = None) -> torch.Tensor:
        C, H = ctx_latent.shape[0], self.num_heads
        kv = self.kv_b_proj(ctx_latent).view(C, H, self.Dn + self.Dv)
        k_nope, v = kv[..., : self.Dn], kv[..., self.Dn :]
        if self.backend == "triton" and allowed is None:
            from kdaserve.ops.mla.prefill import mla_prefill_triton

            return mla_prefill_triton(q_nope, q_pe, k_nope, ctx_pe, v, query_lens, context_lens, self.scale)
        return mla_prefill_reference(q_nope, q_pe, k_nope, ctx_pe, v, query_lens, context_lens, self.scale, allowed)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, latent={self.L}+{self.R}, nope={self.Dn}, "
                f"v={self.Dv}, q_lora={self.q_lora_rank}, rope={self._rope_kind}, head_gate={self.g_proj is not None}, "
                f"backend={self.backend}")

    @property
    def _rope_kind(self) -> str:
        return "none" if self.rotary is None else "interleaved" if self.rotary.interleaved else "rotate-half"
