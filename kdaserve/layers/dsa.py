"""MLA with DeepSeek sparse attention (DSA) and k-pool compression: GLM-5.3-Flash's attention layer.

The indexer (released names `self_attn.indexer.{wq_b, wk, k_norm, weights_proj,
index_kpool_compress_ape, index_kpool_compress_gate}`) keeps, per context token, a key and gate
logits in a paged cache of its own — the second cache tensor of the layer, `[num_blocks,
block_size, 2 * index_head_dim]`, under the same block table as the MLA latent — and chooses for
every query the context tokens it attends to (ops/dsa/reference.py). A layer whose
`indexer_types` entry is "shared" has no indexer: it reuses the choice of the full layer before it
(`source`), made earlier in the same forward. When blocks hold whole pools (block_size a multiple
of kpool) a third cache tensor keeps each completed pool's key, written by the token completing it.

With `--mla-backend triton` (auto on a GPU) the index scores run in a Triton kernel
(ops/dsa/triton_scores.py) and every query (decode rows and prefill queries alike, absorbed) attends
through the sparse MLA kernel, which reads only the chosen cache rows (ops/mla/sparse_decode.py);
the pool keys and the top-k run in torch. The reference path uses the choice as a mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.kernel_choice import resolve_kernel_choice
from kdaserve.layers.mla import MLAttention, Selection, _linear
from kdaserve.ops.dsa.reference import dsa_choose, dsa_choose_indices, dsa_index_scores_reference, dsa_pool_keys


class DSAIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, *, num_heads: int, head_dim: int, kpool: int, topk: int,
                 always_select_tail: bool, backend: str = "auto", dtype=None, device=None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.empty(0).device
        # The scoring kernel (ops/dsa/triton_scores.py) takes power-of-two head sizes of 16 and more.
        self.backend = resolve_kernel_choice("DSA indexer", backend, device)
        if self.backend == "triton" and (head_dim < 16 or head_dim & (head_dim - 1)):
            raise ValueError(f"DSA indexer backend 'triton' needs a power-of-two index_head_dim >= 16, got {head_dim}; "
                             f"use 'reference'")
        self.num_heads, self.head_dim, self.kpool, self.topk = num_heads, head_dim, kpool, topk
        self.always_select_tail = always_select_tail
        self.wq_b = _linear(q_lora_rank, num_heads * head_dim, dtype, device)
        self.wk = _linear(hidden_size, head_dim, dtype, device)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        self.weights_proj = _linear(hidden_size, num_heads, dtype, device)
        kw = dict(dtype=dtype, device=device)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, head_dim, **kw), requires_grad=False)
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden_size, **kw), requires_grad=False)

    def cache_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the cache keeps per token: [T, 2 * head_dim] = key | gate logits."""
        return torch.cat([self.k_norm(self.wk(hidden)), F.linear(hidden, self.index_kpool_compress_gate)], dim=-1)

    def queries(self, q_resid: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [T, Hi, Di], head weights [T, Hi] fp32 with the Hi^-0.5 factor)."""
        q = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        w = self.weights_proj(hidden).float() * self.num_heads**-0.5
        return q, w

    def pool_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache rows [B, C, 2 Di] (from position 0) -> their complete pools' keys [B, C // kpool, Di]."""
        Di = self.head_dim
        return dsa_pool_keys(rows[..., :Di], rows[..., Di:], self.index_kpool_compress_ape, self.kpool)

    def _index_scores(self, q, w, rows, positions, pool_keys=None) -> torch.Tensor:
        pool_keys = self.pool_keys(rows) if pool_keys is None else pool_keys
        if self.backend == "triton":
            from kdaserve.ops.dsa.triton_scores import dsa_index_scores_triton

            return dsa_index_scores_triton(q, w, pool_keys, positions, self.kpool)
        return dsa_index_scores_reference(q, w, pool_keys, positions, self.kpool)

    def select(self, q, w, rows, positions, pool_keys=None) -> torch.Tensor:
        """q [B, n, Hi, Di], w [B, n, Hi], rows [B, C, 2 Di], positions [B, n] -> allowed [B, n, C].
        `pool_keys` [B, >= C // kpool, Di]: the pools' keys already computed (the pool cache)."""
        return dsa_choose(self._index_scores(q, w, rows, positions, pool_keys), positions, rows.shape[1],
                          topk=self.topk, kpool=self.kpool, always_select_tail=self.always_select_tail)

    def select_positions(self, q, w, rows, positions, pool_keys=None) -> torch.Tensor:
        """The same choice as context positions [B, n, topk + kpool - 1] (-1: none); `rows` may be
        None when `pool_keys` are given (only the pools are read)."""
        return dsa_choose_indices(self._index_scores(q, w, rows, positions, pool_keys), positions, topk=self.topk,
                                  kpool=self.kpool, always_select_tail=self.always_select_tail)


class DSAttention(MLAttention):
    def __init__(self, hidden_size: int, num_heads: int, *, indexer: DSAIndexer | None, **mla):
        super().__init__(hidden_size, num_heads, **mla)
        if self.q_lora_rank is None:
            raise ValueError("DSA needs q-LoRA (q_lora_rank): the indexer reads the q_a_layernorm output")
        self.indexer = indexer
        self.source: DSAttention | None = None   # a shared layer's full layer (set by the model)
        self.index_cache: torch.Tensor | None = None
        self.pool_cache: torch.Tensor | None = None   # [blocks, block_size / kpool, Di]: completed pools' keys
        self.last_selection: Selection | None = None

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        shapes = super().cache_shapes(num_blocks, block_size)
        if self.indexer is not None:
            ix = self.indexer
            shapes.append((num_blocks, block_size, 2 * ix.head_dim))
            if block_size % ix.kpool == 0:   # blocks hold whole pools: their keys are kept, not recomputed
                shapes.append((num_blocks, block_size // ix.kpool, ix.head_dim))
        return shapes

    def bind_cache(self, cache: torch.Tensor, index_cache: torch.Tensor | None = None,
                   pool_cache: torch.Tensor | None = None) -> None:
        super().bind_cache(cache)
        if self.indexer is not None:
            want = 2 * self.indexer.head_dim
            if index_cache is None or index_cache.dim() != 3 or index_cache.shape[-1] != want:
                raise ValueError(f"DSA layer {self.layer_idx} needs an indexer cache [num_blocks, block_size, {want}], "
                                 f"got {None if index_cache is None else list(index_cache.shape)}")
            self.index_cache, self.pool_cache = index_cache, pool_cache

    def _store_completed_pools(self, md: AttentionMetadata) -> None:
        """Each token that completes a pool (its position, hence its slot, is kpool - 1 mod kpool:
        blocks start at multiples of the block size, a multiple of kpool) writes that pool's key
        into the pool cache; the others write to the trash block's first pool row (no host sync)."""
        ix = self.indexer
        kp, width = ix.kpool, self.index_cache.shape[-1]
        slots = md.slot_mapping
        first = (slots - (kp - 1)).clamp_min(0)
        rows = self.index_cache.view(-1, width)[first[:, None] + torch.arange(kp, device=slots.device)]   # [T, kp, 2Di]
        keys = ix.pool_keys(rows.reshape(1, -1, width))[0]                                             # [T, Di]
        flat = self.pool_cache.view(-1, self.pool_cache.shape[-1])
        trash = (self.pool_cache.shape[0] - 1) * self.pool_cache.shape[1]
        done = (slots % kp) == kp - 1
        flat.index_copy_(0, torch.where(done, slots // kp, trash), keys.to(flat.dtype))

    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor | None, md: AttentionMetadata) -> Selection:
        if self.indexer is None:
            if self.source is None or self.source.last_selection is None:
                raise RuntimeError(f"shared DSA layer {self.layer_idx} runs before a full indexer layer chose")
            return self.source.last_selection
        ix, width = self.indexer, self.index_cache.shape[-1]
        flat = self.index_cache.view(-1, width)
        flat.index_copy_(0, md.slot_mapping, ix.cache_rows(hidden).to(flat.dtype))
        pooled = self.pool_cache is not None
        if pooled:
            self._store_completed_pools(md)
        q, w = ix.queries(q_resid, hidden)
        nd = md.num_decode_tokens
        decode = prefill = decode_indices = None
        if nd:
            tables = md.decode_block_tables.long()
            positions = (md.decode_context_lens.long() - 1)[:, None]
            # With the pool cache only the pools' keys are read: kpool x 2 fewer bytes than the rows.
            keys = self.pool_cache[tables].reshape(nd, 1, -1, ix.head_dim)[:, 0] if pooled else None
            rows = None if pooled and self.backend == "triton" else self.index_cache[tables].reshape(nd, -1, width)
            if self.backend == "triton":   # positions for the sparse decode kernel: no [rows, context] mask
                decode_indices = ix.select_positions(q[:nd, None], w[:nd, None], rows, positions, keys)[:, 0]
            else:
                decode = ix.select(q[:nd, None], w[:nd, None], rows, positions, keys)[:, 0]
        prefill_rows = None
        if nd < q.shape[0]:
            prefill, chosen_rows, q0, k0 = [], [], nd, 0
            pool_flat = self.pool_cache.view(-1, ix.head_dim) if pooled else None
            for n, ctx in zip(md.prefill_query_lens, md.prefill_context_lens):
                kv_rows = md.prefill_kv_rows[k0 : k0 + ctx]
                keys = pool_flat[kv_rows[ix.kpool - 1 :: ix.kpool] // ix.kpool][None] if pooled else None
                # The indexer rows of the whole context only where the pools must be recomputed from
                # them or the mask needs the context's width.
                rows = None if pooled and self.backend == "triton" else flat[kv_rows][None]
                positions = torch.arange(ctx - n, ctx, device=q.device)[None]
                if self.backend == "triton":   # the chosen positions as flat cache rows, for the sparse kernel
                    pos = ix.select_positions(q[None, q0 : q0 + n], w[None, q0 : q0 + n], rows, positions, keys)[0]
                    chosen_rows.append(torch.where(pos >= 0, kv_rows[pos.long().clamp_min(0)], -1))
                else:
                    prefill.append(ix.select(q[None, q0 : q0 + n], w[None, q0 : q0 + n], rows, positions, keys)[0])
                q0, k0 = q0 + n, k0 + ctx
            if chosen_rows:
                prefill_rows, prefill = torch.cat(chosen_rows), None
        self.last_selection = Selection(decode, prefill, decode_indices, prefill_rows)
        return self.last_selection

    def extra_repr(self) -> str:
        ix = self.indexer
        kind = (f"indexer {ix.num_heads}x{ix.head_dim}, topk {ix.topk}, kpool {ix.kpool}" if ix is not None
                else f"shared selection of layer {self.source.layer_idx if self.source else '?'}")
        return super().extra_repr() + ", " + kind
