"""The reference holds the properties of docs/kda-semantics.md, and its chunked form equals the loop."""

import functools
from dataclasses import replace

import pytest
import torch

from kdaserve.ops.kda.reference import kda_chunked_varlen, kda_decode_reference, kda_prefill_reference, kda_recurrent_varlen
from kdaserve.ops.kda.reference.conv import causal_conv_varlen
from kdaserve.ops.kda.reference.gates import beta_sigmoid, kda_gate
from kdaserve.ops.kda.reference.kda import kda_qkv_prepare
from kdaserve.testing import assert_rel_close, make_kda_case
from kdaserve.testing.properties import (
    check_decode_matches_reference,
    check_mixed_equals_alone,
    check_prefill_matches_reference,
    check_spec_resume,
    check_split_prefill,
    run_decode,
    run_prefill,
)

F64 = dict(dtype=torch.float64, state_dtype=torch.float64)


def core_inputs(case):
    y = causal_conv_varlen(case.qkv, case.weights.conv_weight, case.conv_state, case.cu_seqlens,
                           case.state_indices, case.has_initial_state, case.conv_layout)
    q, k, v = kda_qkv_prepare(y, case.H, case.D)
    gk = kda_gate(case.forget_logits, case.weights.A_log, case.weights.dt_bias, case.weights.lower_bound)
    return q, k, v, gk, beta_sigmoid(case.beta_logits)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("initial", [False, True, None])
def test_chunked_equals_token_loop_fp64(chunk_size, gate, initial):
    case = make_kda_case([1, 70, 16, 33, 130], H=3, D=8, gate=gate, slow_decay_heads=1, has_initial_state=initial,
                         seed=chunk_size, **F64)
    args = core_inputs(case)
    meta = (case.cu_seqlens, case.state_indices, case.has_initial_state)
    pool_loop, pool_chunk = case.recurrent_state.clone(), case.recurrent_state.clone()
    o_loop = kda_recurrent_varlen(*args, pool_loop, *meta)
    o_chunk = kda_chunked_varlen(*args, pool_chunk, *meta, chunk_size=chunk_size)
    assert_rel_close(o_chunk, o_loop, 1e-10, "chunked output")
    assert_rel_close(pool_chunk, pool_loop, 1e-10, "chunked final states")


def test_chunked_rejects_other_chunk_sizes():
    case = make_kda_case([4], **F64)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunked_varlen(*core_inputs(case), case.recurrent_state, case.cu_seqlens, case.state_indices,
                           case.has_initial_state, chunk_size=48)


def test_chunked_stays_finite_at_lower_bound_in_fp32():
    """64-token chunks at LB=-5 reach |g| ~ 320: the chunked form must not overflow in fp32."""
    case = make_kda_case([256], H=2, D=8, has_initial_state=True)
    case.forget_logits.fill_(30.0)  # sigmoid -> 1: every gate at the lower bound
    ref = case.clone()
    out_c = run_prefill(functools.partial(kda_prefill_reference, chunk_size=64), case)
    out_l = run_prefill(kda_prefill_reference, ref)
    assert torch.isfinite(out_c).all()
    assert_rel_close(out_c, out_l, 1e-5, "chunk-64 fp32 at the lower bound")


@pytest.mark.parametrize("split", [1, 17, 40])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_split_prefill_equals_unsplit(split, gate):
    check_split_prefill(kda_prefill_reference, 41, split, 1e-12, gate=gate, **F64)
    check_split_prefill(functools.partial(kda_prefill_reference, chunk_size=16), 41, split, 1e-12, gate=gate, **F64)


@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
def test_spec_verify_then_resume_equals_accepted_only_run(accepted):
    check_spec_resume(kda_prefill_reference, kda_decode_reference, accepted, 1e-12, S=3, **F64)


@pytest.mark.parametrize("accepted", [1, 2])
def test_spec_resume_ds_layout(accepted):
    check_spec_resume(kda_prefill_reference, kda_decode_reference, accepted, 1e-12, S=1, conv_layout="DS", **F64)


def test_layouts_give_identical_results():
    sd = make_kda_case([9, 1, 20], conv_layout="SD", seed=3)
    ds = make_kda_case([9, 1, 20], conv_layout="DS", seed=3)
    assert torch.equal(sd.conv_state, ds.conv_state.transpose(1, 2))
    out_sd, out_ds = run_prefill(kda_prefill_reference, sd), run_prefill(kda_prefill_reference, ds)
    assert torch.equal(out_sd, out_ds)
    assert torch.equal(sd.conv_state, ds.conv_state.transpose(1, 2)) and torch.equal(sd.recurrent_state, ds.recurrent_state)
    dsd = make_kda_case([1] * 5, conv_layout="SD", seed=4, has_initial_state=True)
    dds = make_kda_case([1] * 5, conv_layout="DS", seed=4, has_initial_state=True)
    assert torch.equal(run_decode(kda_decode_reference, dsd), run_decode(kda_decode_reference, dds))
    assert torch.equal(dsd.conv_state, dds.conv_state.transpose(1, 2))


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_prefill_properties_untouched_slots_and_null_rows(layout):
    case = make_kda_case([5, 12, 3], conv_layout=layout, seed=7)
    case.state_indices[1] = 0  # a null row: skipped entirely
    check_prefill_matches_reference(kda_prefill_reference, case, 1e-5)


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_decode_properties_untouched_slots_and_padding(layout):
    case = make_kda_case([1] * 6, conv_layout=layout, has_initial_state=True, seed=8)
    case.state_indices[2] = 0
    case.state_indices[4] = -1
    check_decode_matches_reference(kda_decode_reference, case, 1e-5)


def test_mixed_step_equals_each_sequence_alone():
    check_mixed_equals_alone(kda_prefill_reference, [1, 23, 1, 1, 64, 5], 1e-12, **F64)


def test_decode_equals_one_token_prefill():
    a = make_kda_case([1] * 4, has_initial_state=True, seed=11, **F64)
    b = a.clone()
    out_d = run_decode(kda_decode_reference, a)
    out_p = run_prefill(kda_prefill_reference, b)
    assert_rel_close(out_d, out_p, 1e-14, "decode vs 1-token prefill")
    assert torch.equal(a.conv_state, b.conv_state)


def test_bad_shapes_raise_clear_errors():
    case = make_kda_case([3, 2])
    args = case.prefill_args()
    with pytest.raises(ValueError, match=r"beta_logits must be \[T, H\]"):
        kda_prefill_reference(out=case.new_out(), **{**args,
                                                     "inputs": replace(args["inputs"], beta_logits=case.beta_logits[:, :2])})
    with pytest.raises(ValueError, match=r"cu_seqlens must be \[N\+1\]"):
        kda_prefill_reference(out=case.new_out(), **{**args, "seqs": replace(args["seqs"], cu_seqlens=case.cu_seqlens[:2])})
    with pytest.raises(ValueError, match="conv_layout"):
        kda_prefill_reference(out=case.new_out(), **{**args, "cache": replace(args["cache"], conv_layout="DSD")})
    with pytest.raises(ValueError, match="one token per sequence"):
        kda_decode_reference(out=case.new_out(), **case.decode_args())


def test_empty_step_is_a_no_op():
    """T = 0 (a step with no sequences of this kind) passes the checks and touches nothing."""
    case = make_kda_case([], H=2, D=8)
    before = case.recurrent_state.clone()
    run_prefill(kda_prefill_reference, case)
    run_decode(kda_decode_reference, case)
    assert torch.equal(before, case.recurrent_state)


def test_to_fp64_never_aliases_the_callers_pools():
    """The fp64 ground truth runs on copies, even for a case that is already fp64."""
    from kdaserve.testing.properties import to_fp64

    case = make_kda_case([5], **F64)
    ref = to_fp64(case)
    assert ref.recurrent_state.data_ptr() != case.recurrent_state.data_ptr()
    assert ref.conv_state.data_ptr() != case.conv_state.data_ptr()


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_reference_checkpoints_by_pieces(layout):
    """The reference's state checkpoints (pieces run on copies of the slots) against the reference
    from scratch up to each offset: a sequence with history, one without, one with none asked; the
    step's own outputs and states bit for bit those of a run without checkpoints."""
    from kdaserve.ops.kda.reference import kda_prefill_reference
    from kdaserve.testing.properties import check_prefill_checkpoints

    case = make_kda_case([40, 23, 9], H=2, D=16, conv_layout=layout, has_initial_state=[True, False, True],
                         extra_slots=6, seed=7)
    check_prefill_checkpoints(kda_prefill_reference, case, [[8, 16, 33], [20], []], 1e-6)
