"""Token embedding and LM head, split over the vocabulary at tensor parallel size N (vLLM's
VocabParallelEmbedding and ParallelLMHead): rank r holds rows [r V / N, (r + 1) V / N) of each.

The embedding looks up the ids in its rows (zeros for the others' ids) and the ranks' rows are
summed (one all-reduce: exactly one rank holds each id, so the sum is exact). The head computes
its rows' logits and the ranks' slices are gathered into the whole vocabulary's, on every rank:
every rank calls it on the same rows at the same time (the model runner tells the other ranks the
rows rank 0 samples; engine/model_runner.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.layers.distributed import all_reduce, split, tensor_parallel


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=None, device=None):
        super().__init__()
        self.tp = tensor_parallel()
        rows = split(vocab_size, "the embedding's and LM head's vocabulary rows", self.tp.size)
        self.vocab_start = self.tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.masked_fill(~mine, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.tp)


class LMHead(nn.Module):
    """Logits in fp32 (sampling and log-probs want them). With tied embeddings the weight is the
    embedding's own Parameter, so a load of either name updates both.

    On CUDA a 2-byte GEMM writes fp32 itself (cuBLAS accumulates in fp32 anyway): no rounding to
    2 bytes, and no cast kernel re-reading the (batch x vocab) logits in every decode step. Other
    devices compute in the weight's dtype and cast; so does ROCm, where `mm`'s out_dtype has not run
    on our tests."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: VocabEmbedding | None = None, dtype=None, device=None):
        super().__init__()
        self.tp = tensor_parallel()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            rows = split(vocab_size, "the embedding's and LM head's vocabulary rows", self.tp.size)
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if _writes_fp32(hidden):
            rows = hidden.reshape(-1, hidden.shape[-1])
            local = torch.mm(rows, self.weight.t(), out_dtype=torch.float32).view(*hidden.shape[:-1], self.weight.shape[0])
        else:
            local = F.linear(hidden, self.weight).float()
        return local if self.tp.size == 1 else _gather_vocab(local, self.tp)


def _gather_vocab(local: torch.Tensor, tp) -> torch.Tensor:
    """[..., V / N] on each rank -> [..., V], the ranks' slices in rank order."""
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _writes_fp32(hidden: torch.Tensor) -> bool:
    return hidden.is_cuda and torch.version.hip is None and hidden.dtype in (torch.bfloat16, torch.float16)
