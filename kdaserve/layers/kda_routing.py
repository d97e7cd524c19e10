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
from kdaserve.backends.step import KDACache, KDAInputs, KDAStep, KDAStepMetadata
from kdaserve.ops.kda.types import KDAWeights


def step_route(step: KDAStep | None) -> str:
    if step is None or step.num_tokens == 0:
        return "none"
    if step.decode is not None and step.prefill is not None:
        return "mixed"
    if step.decode is not None:
        return "speculative" if step.is_speculative else "decode"
    return "prefill"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"KDA step: {msg}")


def run_kda_step(
    step: KDAStep | None,
    inputs: KDAInputs,
    weights: KDAWeights,
    cache: KDACache | None,
    out: torch.Tensor,
    backends: KDABackends,
) -> str:
    """Run one step's KDA core into `out` [T, H, D] with the resolved backends and the step they
    built (`backends.build_step(meta)`, once for all layers); returns the route."""
    route = step_route(step)
    if route == "none":
        return route
    T = inputs.qkv.shape[0]
    _check(T == step.num_tokens, f"{T} tokens given, but the step counts {step.num_decode_tokens} decode + "
           f"{step.num_prefill_tokens} prefill tokens")
    _check(cache is not None, "the layer has no cache bound (call bind_cache)")
    _check(step.built_by is backends, f"built by the {step.built_by.names} pair for {step.built_by.num_heads} heads, "
           f"run by the layer's {backends.names} for {backends.num_heads}: build the step with the layers' own backends")
    nd = step.num_decode_tokens
    if step.decode is not None:
        d = slice(0, nd)
        backends.decode.decode(inputs.rows(d), weights, cache, step.decode, out[d])
    if step.prefill is not None:
        p = slice(nd, T)
        backends.prefill.prefill(inputs.rows(p), weights, cache, step.prefill, out[p])
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
