"""Behavioural properties every KDA prefill/decode implementation must have.

Each check takes the implementation under test (functions with the calling convention of
`kda_prefill_reference` / `kda_decode_reference`) and raises AssertionError on violation, so the
reference, the Triton backends and external adapters are all held to the same standard.
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.reference import kda_decode_reference, kda_prefill_reference
from kdaserve.ops.kda.types import conv_state_rows
from kdaserve.testing.compare import assert_rel_close, assert_slots_untouched
from kdaserve.testing.inputs import KDACase, make_kda_case


def to_fp64(case: KDACase) -> KDACase:
    """The same case in fp64 (views kept as views), for ground-truth reference runs."""
    # Convert the clone's own tensors: `.double()` of an fp64 tensor is the tensor itself, and the
    # reference run must never write into the caller's pools.
    c = case.clone()
    c.proj = c.proj.double()
    P = case.H * case.D
    c.qkv, c.beta_logits = c.proj[:, : 3 * P], c.proj[:, 3 * P : 3 * P + case.H]
    c.forget_logits, c.output_gate_logits = case.forget_logits.double(), case.output_gate_logits.double()
    c.conv_state, c.recurrent_state = c.conv_state.double(), c.recurrent_state.double()
    return c


def run_prefill(fn, case: KDACase, out_dtype=None, **kw) -> torch.Tensor:
    out = case.new_out(out_dtype)
    fn(out=out, **case.prefill_args(), **kw)
    return out


def run_decode(fn, case: KDACase, out_dtype=None, spec_state_indices=None, num_accepted_tokens=None, **kw) -> torch.Tensor:
    """A decode step of `case` (a verify step with the speculative slots given) into a NaN output."""
    out = case.new_out(out_dtype)
    fn(out=out, **case.decode_args(spec_state_indices, num_accepted_tokens), **kw)
    return out


def valid_rows(case: KDACase) -> torch.Tensor:
    rows = torch.repeat_interleave(case.state_indices.cpu() > 0, torch.tensor(case.seq_lens))
    return rows.to(case.qkv.device)


def check_prefill_matches_reference(prefill_fn, case: KDACase, tol: float, chunk_size=None) -> None:
    """Output, final states and conv states against the fp64 reference; other slots bit-exact."""
    ref = to_fp64(case)
    kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    ref_out = run_prefill(kda_prefill_reference, ref, out_dtype=torch.float64, **kw)
    before_rec, before_conv = case.recurrent_state.clone(), case.conv_state.clone()
    out = run_prefill(prefill_fn, case)
    rows = valid_rows(case)
    assert_rel_close(out[rows], ref_out[rows], tol, "prefill output")
    used = [s for s in case.state_indices.tolist() if s > 0]
    assert_rel_close(case.recurrent_state[used], ref.recurrent_state[used], tol, "prefill final state")
    cs, rs = conv_state_rows(case.conv_state, case.conv_layout), conv_state_rows(ref.conv_state, case.conv_layout)
    assert torch.equal(cs[used].double(), rs[used].to(cs.dtype).double()), "prefill conv state differs from the reference"
    assert_slots_untouched(before_rec, case.recurrent_state, used, "recurrent_state")
    assert_slots_untouched(before_conv, case.conv_state, used, "conv_state")
    # Output rows of a prefill sequence whose slot is <= 0 are unspecified (only decode pads).


def with_padding_rows(case: KDACase, *rows: int) -> KDACase:
    """Turn decode rows into padding: the first gets slot 0, the second -1, the third 0 (both
    spellings of 'no slot' that the engine's fixed-size batches use); they must stay untouched."""
    for r, s in zip(rows, (0, -1, 0)):
        case.state_indices[r] = s
    return case


def with_fused_decode_layout(case: KDACase) -> KDACase:
    """The case's weights with the conv-weight layout the fused decode reads (as the layer builds it)."""
    from kdaserve.ops.kda.fused import fused_conv_weight_layout  # only decode tests need the fused package

    case.weights.conv_weight_decode = fused_conv_weight_layout(case.weights.conv_weight)
    return case


def check_decode_matches_reference(decode_fn, case: KDACase, tol: float, **kw) -> None:
    ref = to_fp64(case)
    ref_out = run_decode(kda_decode_reference, ref, out_dtype=torch.float64, **kw)
    before_rec, before_conv = case.recurrent_state.clone(), case.conv_state.clone()
    out = run_decode(decode_fn, case, **kw)
    spec = kw.get("spec_state_indices")
    if spec is None:
        rows, used_rec = case.state_indices > 0, [s for s in case.state_indices.tolist() if s > 0]
    else:
        rows = (spec[:, :1] > 0).expand(spec.shape).reshape(-1)
        used_rec = [s for row in spec.tolist() if row[0] > 0 for s in row if s > 0]
    used_conv = [s for s in case.state_indices.tolist() if s > 0]
    assert_rel_close(out[rows], ref_out[rows], tol, "decode output")
    assert_rel_close(case.recurrent_state[used_rec], ref.recurrent_state[used_rec], tol, "decode state")
    cs, rs = conv_state_rows(case.conv_state, case.conv_layout), conv_state_rows(ref.conv_state, case.conv_layout)
    assert torch.equal(cs[used_conv].double(),
                       rs[used_conv].to(cs.dtype).double()), "decode conv state differs from the reference"
    assert_slots_untouched(before_rec, case.recurrent_state, used_rec, "recurrent_state")
    assert_slots_untouched(before_conv, case.conv_state, used_conv, "conv_state")
    if not rows.all():
        assert torch.isnan(out[~rows]).all(), "decode wrote output rows of padding (slot <= 0)"


def check_decode_agrees(decode_fn, other_fn, case: KDACase, tol: float, what: str) -> None:
    """decode_fn on `case` and other_fn on a copy of it give the same output rows (slot > 0) and
    recurrent states within tol, and bit-equal conv states (two backends, no reference)."""
    other = case.clone()
    out, out_other = run_decode(decode_fn, case), run_decode(other_fn, other)
    rows = case.state_indices > 0
    assert_rel_close(out[rows].float(), out_other[rows].float(), tol, f"{what} output")
    assert_rel_close(case.recurrent_state, other.recurrent_state, tol, f"{what} state")
    assert torch.equal(case.conv_state, other.conv_state), f"{what} conv state"


def sub_case(case: KDACase, t0: int, t1: int, *, has_initial_state: bool) -> KDACase:
    """Tokens [t0, t1) of a single-sequence case as a step of its own, sharing the case's pools."""
    c = case.clone()
    c.conv_state, c.recurrent_state = case.conv_state, case.recurrent_state
    c.proj = case.proj[t0:t1]
    P = case.H * case.D
    c.qkv, c.beta_logits = c.proj[:, : 3 * P], c.proj[:, 3 * P : 3 * P + case.H]
    c.forget_logits, c.output_gate_logits = case.forget_logits[t0:t1], case.output_gate_logits[t0:t1]
    c.seq_lens = [t1 - t0]
    cu = torch.tensor([0, t1 - t0], dtype=torch.int32)
    c.cu_seqlens, c.cu_seqlens_cpu = cu.to(case.qkv.device), cu
    c.has_initial_state = torch.tensor([has_initial_state], device=case.qkv.device)
    return c


def check_split_prefill(prefill_fn, length: int, split: int, tol: float, **case_kw) -> None:
    """Prefix then the rest (resumed from the written states, conv included) == one prefill."""
    case = make_kda_case([length], has_initial_state=False, **case_kw)
    whole = case.clone()
    out_whole = run_prefill(prefill_fn, whole)
    out_a = run_prefill(prefill_fn, sub_case(case, 0, split, has_initial_state=False))
    out_b = run_prefill(prefill_fn, sub_case(case, split, length, has_initial_state=True))
    assert_rel_close(torch.cat([out_a, out_b]), out_whole, tol, "split prefill output")
    slot = case.state_indices.tolist()
    assert_rel_close(case.recurrent_state[slot], whole.recurrent_state[slot], tol, "split prefill final state")
    assert torch.equal(case.conv_state[slot], whole.conv_state[slot]), "split prefill conv state differs"


def check_mixed_equals_alone(prefill_fn, seq_lens: list[int], tol: float, **case_kw) -> None:
    """A varlen step of several sequences == each sequence in a step of its own."""
    case = make_kda_case(seq_lens, **case_kw)
    together = case.clone()
    out_all = run_prefill(prefill_fn, together)
    cu = case.cu_seqlens_cpu.tolist()
    for n in range(case.N):
        alone = case.clone()
        alone.conv_state, alone.recurrent_state = case.conv_state, case.recurrent_state
        one = sub_case(alone, cu[n], cu[n + 1], has_initial_state=bool(case.has_initial_state[n]))
        one.state_indices = case.state_indices[n : n + 1]
        out = run_prefill(prefill_fn, one)
        assert_rel_close(out, out_all[cu[n] : cu[n + 1]], tol, f"sequence {n} alone vs in a mixed step")
    assert_rel_close(case.recurrent_state, together.recurrent_state, tol, "states alone vs mixed")
    assert torch.equal(case.conv_state, together.conv_state), "conv states alone vs mixed differ"


def check_spec_resume(prefill_fn, decode_fn, accepted: int, tol: float, S: int = 3, **case_kw) -> None:
    """Verify S+1 drafts, accept `accepted`, verify the next S+1: the second step must equal a run
    that only ever saw the prompt, the accepted drafts and then the new tokens (conv included)."""
    prompt = 7
    total = prompt + 2 * (S + 1)
    base = make_kda_case([total], has_initial_state=False, spec_tokens=S, **case_kw)
    dev = base.qkv.device
    home = int(base.state_indices[0])
    others = [s for s in range(1, base.recurrent_state.shape[0]) if s != home][:S]

    # Spec run: prefill, verify d (all S+1 taken as "after prefill": resume from the home slot),
    # then verify e after accepting `accepted` of d.
    spec = base.clone()
    run_prefill(prefill_fn, sub_case(spec, 0, prompt, has_initial_state=False))
    row = torch.tensor([others + [home]], dtype=torch.int32, device=dev)  # resume slot last
    d = sub_case(spec, prompt, prompt + S + 1, has_initial_state=True)
    run_decode(decode_fn, d, spec_state_indices=row, num_accepted_tokens=torch.tensor([S + 1], device=dev, dtype=torch.int32))
    e = sub_case(spec, prompt + S + 1, total, has_initial_state=True)
    out_spec = run_decode(decode_fn, e, spec_state_indices=row,
                          num_accepted_tokens=torch.tensor([accepted], device=dev, dtype=torch.int32))

    # Plain run over prompt ++ d[:accepted] ++ e.
    plain = base.clone()
    keep = torch.cat([torch.arange(prompt + accepted), torch.arange(prompt + S + 1, total)])
    rows = keep.to(dev)
    plain.proj, plain.forget_logits, plain.output_gate_logits = (base.proj[rows], base.forget_logits[rows],
                                                                 base.output_gate_logits[rows])
    P = base.H * base.D
    plain.qkv, plain.beta_logits = plain.proj[:, : 3 * P], plain.proj[:, 3 * P : 3 * P + base.H]
    n = prompt + accepted
    run_prefill(prefill_fn, sub_case(plain, 0, n, has_initial_state=False))
    out_plain = run_prefill(prefill_fn, sub_case(plain, n, n + S + 1, has_initial_state=True))

    assert_rel_close(out_spec, out_plain, tol, f"verify after accepting {accepted} vs plain run")
    assert_rel_close(spec.recurrent_state[home], plain.recurrent_state[home], tol, "state after the last draft")
    W = base.weights.conv_width
    spec_rows = conv_state_rows(spec.conv_state, spec.conv_layout)[home]
    plain_rows = conv_state_rows(plain.conv_state, plain.conv_layout)[home]
    assert torch.equal(spec_rows[-(W - 1) :], plain_rows[-(W - 1) :]), "conv history after verify differs"


def check_long_decode(decode_fn, case: KDACase, steps: int, tol: float, gate_logits=None) -> None:
    """`steps` decode steps in a row on fresh inputs (errors compound through the state): every
    step's output and the final states stay within `tol` of an fp64 reference run.

    gate_logits(shape, generator) -> fp32 tensor draws each step's forget-gate logits forget_logits
    (default: standard normal)."""
    dev = case.qkv.device
    ref_conv = case.conv_state.double()
    # The reference keeps the pool's storage: with a bf16 pool it rounds the state to bf16 after
    # every step, which is what a bf16 state means; how far that option drifts from fp32 storage is
    # benchmarks/accuracy_bf16_state.py's question, not this kernel check's.
    ref_rec = case.recurrent_state.double() if case.recurrent_state.dtype == torch.float32 else case.recurrent_state.clone()
    gen = torch.Generator(device=dev).manual_seed(41)
    draw_forget_logits = gate_logits or (lambda shape, generator: torch.randn(shape, generator=generator, device=dev))
    P = case.H * case.D
    for step in range(steps):
        case.proj.copy_(torch.randn(case.proj.shape, generator=gen, device=dev))
        case.proj[:, 3 * P : 3 * P + case.H] *= 2.0
        case.forget_logits.copy_(draw_forget_logits(case.forget_logits.shape, gen))
        case.output_gate_logits.copy_(torch.randn(case.output_gate_logits.shape, generator=gen, device=dev))
        ref = to_fp64(case)
        ref.conv_state, ref.recurrent_state = ref_conv, ref_rec
        ref_out = run_decode(kda_decode_reference, ref, out_dtype=torch.float64)
        out = run_decode(decode_fn, case)
        assert_rel_close(out, ref_out, tol, f"decode output at step {step}")
    slots = case.state_indices.tolist()
    assert_rel_close(case.recurrent_state[slots], ref_rec[slots], tol, f"state after {steps} steps")
    assert torch.equal(case.conv_state.double(), ref_conv), "conv states drifted from the reference"


def check_prefill_checkpoints(prefill_fn, case: KDACase, offsets: list[list[int]], tol: float) -> None:
    """State checkpoints taken inside a prefill (prefix caching): sequence n's checkpoint after
    offsets[n][j] of its new tokens, in a free slot, holds the state the fp64 reference reaches
    after just those tokens (from the sequence's initial state) and, bit for bit, the conv rows
    it leaves; the step's outputs, final states and conv states equal a run without checkpoints
    bit for bit (whether a request takes checkpoints must not change its tokens); every other slot
    is untouched."""
    from kdaserve.ops.kda.types import CheckpointRequests, PrefillSeqs

    used = [s for s in case.state_indices.tolist() if s > 0]
    free = [s for s in range(1, case.recurrent_state.shape[0]) if s not in used]
    pairs, want = [], {}
    cu = case.cu_seqlens_cpu.tolist()
    for n, offs in enumerate(offsets):
        row = []
        for o in offs:
            slot = free.pop(0)
            row.append((o, slot))
            alone = to_fp64(case)
            one = sub_case(alone, cu[n], cu[n] + o, has_initial_state=bool(case.has_initial_state[n]))
            one.state_indices = case.state_indices[n : n + 1]
            run_prefill(kda_prefill_reference, one, out_dtype=torch.float64)
            own = int(case.state_indices[n])
            want[slot] = (one.recurrent_state[own], conv_state_rows(one.conv_state, case.conv_layout)[own])
        pairs.append(row)
    plain = case.clone()
    out_plain = run_prefill(prefill_fn, plain)
    before_rec, before_conv = case.recurrent_state.clone(), case.conv_state.clone()
    ck = CheckpointRequests.build(pairs, case.qkv.device)
    out = case.new_out()
    seqs = PrefillSeqs(case.cu_seqlens, case.state_indices, case.has_initial_state, case.cu_seqlens_cpu, ck)
    prefill_fn(out=out, inputs=case.inputs, weights=case.weights, cache=case.cache, seqs=seqs)
    rows = valid_rows(case)
    assert torch.equal(out[rows], out_plain[rows]), "checkpoints changed the prefill output"
    assert torch.equal(case.recurrent_state[used], plain.recurrent_state[used]), "checkpoints changed the final states"
    assert torch.equal(case.conv_state[used], plain.conv_state[used]), "checkpoints changed the conv states"
    cs = conv_state_rows(case.conv_state, case.conv_layout)
    for slot, (state, conv) in want.items():
        assert_rel_close(case.recurrent_state[slot], state, tol, f"checkpoint state in slot {slot}")
        assert torch.equal(cs[slot].double(), conv.to(cs.dtype).double()), f"checkpoint conv rows in slot {slot}"
    touched = used + list(want)
    assert_slots_untouched(before_rec, case.recurrent_state, touched, "recurrent_state")
    assert_slots_untouched(before_conv, case.conv_state, touched, "conv_state")
