"""Which kernel runs which tokens of a step, by the step's metadata (docs/kda-semantics.md section 3).

Token order in a step is decodes first (one token per decode sequence, or S+1 per speculative
sequence), then the prefill tokens. So:

- no metadata, or no tokens           -> "none": nothing runs, no state is touched;
- only decodes                        -> "decode": the decode backend, one token per sequence;
- only speculative verifies           -> "speculative": the decode (recurrent) backend with
                                         per-token state slots;
- only prefills                       -> "prefill": the prefill backend (varlen);
- decodes (plain or speculative) and prefills -> "mixed": the decode backend on the fixed-shape
  prefix, the prefill backend on the rest. Each sequence gets what it would get alone.

Everything here reads host-side metadata only (shapes, counts): no device->host sync.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kdaserve.backends import KDABackends
from kdaserve.backends.step import KDACache, KDAInputs, KDAStepMetadata, KDAStepPlan
from kdaserve.ops.types import KDAWeights


def step_route(meta: KDAStepMetadata | None) -> str:
    if meta is None or meta.num_tokens == 0:
        return "none"
    has_decode = meta.num_decodes > 0
    if has_decode and meta.num_prefills > 0:
        return "mixed"
    if has_decode:
        return "speculative" if meta.is_speculative else "decode"
    return "prefill"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"KDA step metadata: {msg}")


def run_kda_step(
    meta: KDAStepMetadata | None,
    plan: KDAStepPlan | None,
    inputs: KDAInputs,
    weights: KDAWeights,
    cache: KDACache | None,
    out: torch.Tensor,
    backends: KDABackends,
) -> str:
    """Run one step's KDA core into `out` [T, H, D] with the resolved backends and the step's plan
    (from `backends.plan_step(meta)`, built once for all layers); returns the route."""
    route = step_route(meta)
    if route == "none":
        return route
    T = inputs.qkv.shape[0]
    _check(T == meta.num_tokens, f"{T} tokens given, but the metadata counts {meta.num_decode_tokens} decode + "
           f"{meta.num_prefill_tokens} prefill tokens")
    _check(cache is not None, "the layer has no cache bound (call bind_cache)")
    nd = meta.num_decode_tokens
    if meta.num_decodes:
        _check(meta.decode_state_indices is not None, "decodes without decode_state_indices")
        _check(not meta.is_speculative or meta.num_accepted_tokens is not None,
               "speculative decodes without num_accepted_tokens")
        _check(plan is not None and plan.decode is not None, "decodes without a decode plan (backends.plan_step(meta))")
        d = slice(0, nd)
        backends.decode.decode(inputs.rows(d), weights, cache, plan.decode, out[d])
    if meta.num_prefills:
        _check(meta.prefill_cu_seqlens is not None and meta.prefill_state_indices is not None
               and meta.prefill_has_initial_state is not None, "prefills without cu_seqlens / state_indices / has_initial_state")
        _check(plan is not None and plan.prefill is not None, "prefills without a prefill plan (backends.plan_step(meta))")
        p = slice(nd, T)
        backends.prefill.prefill(inputs.rows(p), weights, cache, plan.prefill, out[p])
    return route


def make_kda_metadata(
    *,
    decode_slots: Sequence[int] = (),
    prefill_lens: Sequence[int] = (),
    prefill_slots: Sequence[int] = (),
    prefill_has_initial_state: Sequence[bool] = (),
    spec_slots: Sequence[Sequence[int]] | None = None,
    num_accepted_tokens: Sequence[int] | None = None,
    device="cpu",
) -> KDAStepMetadata:
    """A step's metadata from host lists (tests, benchmarks, `kdaserve parity`); the engine builds
    the same object from its own host-side bookkeeping. With `spec_slots` ([N, S+1]) the decodes
    are speculative verifies of S+1 tokens each."""
    i32 = dict(dtype=torch.int32)
    nd = len(decode_slots)
    if len(prefill_slots) != len(prefill_lens) or len(prefill_has_initial_state) != len(prefill_lens):
        raise ValueError("prefill_lens, prefill_slots and prefill_has_initial_state must have one entry per prefill")
    m = KDAStepMetadata(num_decodes=nd, num_decode_tokens=nd)
    if nd:
        m.decode_state_indices = torch.tensor(list(decode_slots), **i32).to(device)
    if spec_slots is not None:
        spec = torch.tensor([list(r) for r in spec_slots], **i32)
        if spec.shape[0] != nd or num_accepted_tokens is None or len(num_accepted_tokens) != nd:
            raise ValueError("speculative metadata needs spec_slots [N, S+1] and num_accepted_tokens [N] for the N decodes")
        m.spec_state_indices = spec.to(device)
        m.num_accepted_tokens = torch.tensor(list(num_accepted_tokens), **i32).to(device)
        m.num_decode_tokens = nd * spec.shape[1]
    if prefill_lens:
        cu = torch.zeros(len(prefill_lens) + 1, **i32)
        cu[1:] = torch.tensor(list(prefill_lens), **i32).cumsum(0)
        m.num_prefills, m.num_prefill_tokens = len(prefill_lens), int(cu[-1])
        m.prefill_cu_seqlens, m.prefill_cu_seqlens_cpu = cu.to(device), cu
        m.prefill_state_indices = torch.tensor(list(prefill_slots), **i32).to(device)
        m.prefill_has_initial_state = torch.tensor(list(prefill_has_initial_state), dtype=torch.bool).to(device)
    return m
