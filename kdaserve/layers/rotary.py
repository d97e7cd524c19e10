"""Rotary position embedding, optionally partial: only the first `rotary_dim` channels of each head
rotate (GLM's partial_rotary_factor).

Two pairings of the rotated channels: rotate-half (HF Llama / GLM: channel j pairs with j + r/2)
and **interleaved** (DeepSeek's MLA, Ling-3: channel 2j pairs with 2j + 1). The interleaved form
returns its result de-interleaved, [rotated evens | rotated odds], as transformers'
`apply_rotary_pos_emb_interleave` does: q and k are permuted alike, so their dot products are
those of the interleaved layout and a cache may keep either, as long as q and k agree."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, *, interleaved: bool = False,
                 device=None):
        super().__init__()
        self.interleaved = interleaved
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
        t = torch.arange(max_position, dtype=torch.float64, device=device)
        freqs = torch.outer(t, inv_freq)
        # fp32 table indexed by position: no per-step trig, and fixed addresses for CUDA graphs.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1).float(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot, rest = x[..., :r].float(), x[..., r:]
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if self.interleaved else rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
        return out if r == self.head_dim else torch.cat([out, rest], -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, head_dim], k [T, Hkv, head_dim], positions [T] -> rotated (q, k)."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
