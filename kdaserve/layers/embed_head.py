"""Token embedding and LM head (single device: no vocab sharding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in fp32 (sampling and log-probs want them). With tied embeddings the weight is the
    embedding's own Parameter, so a load of either name updates both.

    On CUDA a 2-byte GEMM writes fp32 itself (cuBLAS accumulates in fp32 anyway): no rounding to
    2 bytes, and no cast kernel re-reading the (batch x vocab) logits in every decode step. Other
    devices compute in the weight's dtype and cast; so does ROCm, where `mm`'s out_dtype has not run
    on our tests."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: VocabEmbedding | None = None, dtype=None, device=None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if _writes_fp32(hidden):
            rows = hidden.reshape(-1, hidden.shape[-1])
            return torch.mm(rows, self.weight.t(), out_dtype=torch.float32).view(*hidden.shape[:-1], self.weight.shape[0])
        return F.linear(hidden, self.weight).float()


def _writes_fp32(hidden: torch.Tensor) -> bool:
    return hidden.is_cuda and torch.version.hip is None and hidden.dtype in (torch.bfloat16, torch.float16)
