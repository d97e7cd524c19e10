"""The one builder of a step's Context, from the step's staged device tensors (named as HostStep
names them: one name per field from the scheduler to the kernels) and its host counts. The eager
path builds it over the step's packed buffer, CUDA-graph capture over the graphs' static buffers
(vLLM's per-backend metadata builders: `build_step` / `build_for_capture`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kdaserve.backends.kda_backends import KDABackends
from kdaserve.backends.step import KDAStepMetadata
from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.context import Context
from kdaserve.ops.kda.types import CheckpointRequests


def build_context(views: Mapping[str, torch.Tensor], kda_backends: KDABackends | None, *, num_decodes: int,
                  tokens_per_decode: int = 1, prefill_query_lens: Sequence[int] = (),
                  prefill_context_lens: Sequence[int] = (), prefill_cu_seqlens_cpu: torch.Tensor | None = None,
                  prefill_checkpoints: CheckpointRequests | None = None, for_capture: bool = False) -> Context:
    """`views`: the step's tensors; the decode ones may be longer than the step (a graph's static
    buffers) and are cut to its `num_decodes` sequences (x `tokens_per_decode` rows each, S+1 for
    a speculative verify). `kda_backends`: the model's resolved pair (None: no KDA layers)."""
    nd, m = num_decodes, tokens_per_decode
    rows, spec = nd * m, m > 1 and nd > 0
    num_prefills = len(prefill_query_lens)
    kda = None
    if kda_backends is not None:
        meta = KDAStepMetadata(
            num_decodes=nd, num_decode_tokens=rows,
            decode_state_indices=views["decode_state_indices"][:nd] if nd else None,
            spec_state_indices=views["spec_state_indices"][:nd] if spec else None,
            num_accepted_tokens=views["num_accepted_tokens"][:nd] if spec else None,
            num_prefills=num_prefills, num_prefill_tokens=sum(prefill_query_lens),
            prefill_cu_seqlens=views["prefill_cu_seqlens"] if num_prefills else None,
            prefill_cu_seqlens_cpu=prefill_cu_seqlens_cpu,
            prefill_state_indices=views["prefill_state_indices"] if num_prefills else None,
            prefill_has_initial_state=views["prefill_has_initial_state"] if num_prefills else None,
            prefill_checkpoints=prefill_checkpoints,
        )
        kda = kda_backends.build_for_capture(meta) if for_capture else kda_backends.build_step(meta)
    return Context(kda=kda, attn=AttentionMetadata.build(views, rows, prefill_query_lens, prefill_context_lens))
