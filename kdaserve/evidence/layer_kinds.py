"""A hybrid model's step by layer kind: which kind a device kernel belongs to (by its name), the
device time of each kind in a torch.profiler trace, and the bytes each kind must move in a decode
step (its memory floor), so each part can be set against its own floor.

Kinds, first match wins (our Triton kernels by their names, cuBLAS's by theirs):
  MoE experts  the grouped expert GEMMs, the slot alignment, the sum over the k choices
  MLA          the latent-cache kernels (decode, split-context merge, prefill, the cache write)
  KDA          conv, the recurrence (flash prefill, fused / stream decode), the gated output norm
  GEMMs        cuBLAS (GEMMs and GEMVs) and the FP8 block GEMM: projections, shared experts,
               router, LM head
  other        RMSNorm, SwiGLU, rotary, routing, elementwise, sampling, copies: no floor of their own

Decode floor of each kind (bytes that must move; time = bytes / the copy bandwidth):
  MoE experts  the routed experts the step touches, E * (1 - (1 - k/E)^B) per MoE layer for
               uniform routing (random weights route near-uniformly, not exactly), with their
               FP8 scales where quantized, and the shared expert where the fused kernels run it
               (layers/moe: decode-sized steps)
  MLA          the latent rows of every sequence's context, read once per MLA layer
  KDA          every KDA layer's state slots (recurrent state and conv window), read and written
  GEMMs        every other weight but the embedding table (read by a gather of B rows only); the
               LM head's weight is counted even where it is the embedding's (tied)
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from kdaserve.engine.caches import kv_bytes_per_block, state_bytes_per_slot

MOE = "MoE experts (grouped GEMMs, alignment, sum)"
MLA = "MLA attention"
KDA = "KDA (conv, core, gated norm)"
GEMM = "GEMMs (projections, shared experts, router, head)"
OTHER = "other (norms, rotary, routing, elementwise, sampling)"
KINDS = (
    (MOE, ("_moe_", "_align_")),
    (MLA, ("_mla_", "mla_latent_write")),
    (KDA, ("flash_", "conv_", "kda_", "gated_rms_norm")),
    (GEMM, ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas")),
)
ALL_KINDS = tuple(k for k, _ in KINDS) + (OTHER,)

# Expert tensors of an MoE layer (layers/moe.MoEMLP): the routed experts, stacked by expert.
_EXPERT_PARAMS = ("w13", "w2", "w13_scale_inv", "w2_scale_inv")


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((kind for kind, subs in KINDS if any(s in name for s in subs)), OTHER)


def device_ms_by_kind(events) -> tuple[dict[str, float], Counter]:
    """Device ms per kind (and "total") summed over a profiler's CUDA events (`prof.events()`),
    and the "other" kind's kernels by name (their ms), so what it holds can be read."""
    out, other = dict.fromkeys(ALL_KINDS, 0.0), Counter()
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = getattr(e, "device_time_total", 0.0) / 1e3
        kind = kind_of(e.name)
        out[kind] += ms
        if kind == OTHER:
            other[e.name[:90]] += ms
    out["total"] = sum(out[k] for k in ALL_KINDS)
    return out, other


def device_ms_by_kernel(events) -> tuple[Counter, Counter]:
    """Device ms and launches per kernel name (cut to 90 characters) over a profiler's CUDA events:
    which kernels make a step's time, beyond its kind."""
    ms, launches = Counter(), Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[e.name[:90]] += getattr(e, "device_time_total", 0.0) / 1e3
            launches[e.name[:90]] += 1
    return ms, launches


def device_launches(events) -> int:
    """How many device activities (kernels, copies, fills) a profiler's trace holds: a decode
    step's count is what benchmarks/decode_launches.py predicts on the CPU."""
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts B tokens route to under uniform routing of k distinct experts each."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if all(hasattr(m, p) for p in ("w13", "w2", "router"))]


def expert_bytes(moe: nn.Module) -> float:
    """Bytes of one routed expert (gate|up and down weights, with FP8 scales if any)."""
    total = sum(getattr(moe, p).nbytes for p in _EXPERT_PARAMS if getattr(moe, p, None) is not None)
    return total / moe.router.num_experts


def dense_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter but the routed experts and the embedding table, plus the LM head's
    weight where it is tied to the embedding (a decode step reads it whole either way)."""
    experts = {id(getattr(m, p)) for m in _moe_layers(model) for p in _EXPERT_PARAMS if getattr(m, p, None) is not None}
    embed = model.model.embed_tokens.weight
    total = sum(p.nbytes for p in model.parameters() if id(p) not in experts and p is not embed)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return total + (head.nbytes if head is embed else 0)


def decode_floor_bytes(model: nn.Module, batch: int, context: int, kv_dtype: torch.dtype) -> dict[str, float]:
    """Bytes a decode step of `batch` sequences of `context` tokens must move, per kind (the
    module's docstring says what each counts); "experts_touched": per MoE layer, the estimate used."""
    moes = _moe_layers(model)
    touched = experts_touched(moes[0].router.num_experts, moes[0].router.top_k, batch) if moes else 0.0
    # A shared expert the MoE kernels run (at this batch) is read by them, not by a GEMM.
    shared = sum(sum(w.nbytes for w in s) for m in moes if (s := m.shared_as_expert(batch)) is not None)
    return {
        MOE: sum(touched * expert_bytes(m) for m in moes) + shared,
        MLA: batch * context * kv_bytes_per_block(model, 1, kv_dtype),
        KDA: 2 * batch * state_bytes_per_slot(model),
        GEMM: dense_weight_bytes(model) - shared,
        "experts_touched": touched,
    }
