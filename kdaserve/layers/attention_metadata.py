"""The paged-attention layers' per-step metadata (full attention, MLA, DSA all read it from
`Context.attn`) and its one builder, used for an eager step and for a CUDA graph's static buffers
alike. Token order as in the KDA step: decode rows first, then the prefill rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                        # [T] int64 flat cache row of each token's K/V
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None   # [B, width] int32 (unused entries: 0, the null block)
    decode_context_lens: torch.Tensor | None = None   # [B] int32, tokens visible to each decode row (>= 1)
    prefill_query_lens: list[int] = field(default_factory=list)    # host: new tokens per prefill sequence
    prefill_context_lens: list[int] = field(default_factory=list)  # host: cached + new tokens
    prefill_kv_rows: torch.Tensor | None = None       # [sum context_lens] int64 cache rows of each whole context

    @classmethod
    def build(cls, views: Mapping[str, torch.Tensor], num_decode_tokens: int, prefill_query_lens: Sequence[int] = (),
              prefill_context_lens: Sequence[int] = ()) -> "AttentionMetadata":
        """From the step's staged tensors (named as the fields above; the decode ones' first
        `num_decode_tokens` rows are the step's) and its host lengths. A CUDA graph's capture
        passes its static buffers and no prefills."""
        rows = num_decode_tokens
        has_prefill = bool(prefill_query_lens)
        return cls(
            slot_mapping=views["slot_mapping"][: rows + sum(prefill_query_lens)],
            num_decode_tokens=rows,
            decode_block_tables=views["decode_block_tables"][:rows] if rows else None,
            decode_context_lens=views["decode_context_lens"][:rows] if rows else None,
            prefill_query_lens=list(prefill_query_lens),
            prefill_context_lens=list(prefill_context_lens),
            prefill_kv_rows=views["prefill_kv_rows"] if has_prefill else None,
        )
