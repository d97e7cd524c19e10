"""Triton causal conv (varlen prefill and decode update) against the torch reference.

On CPU the kernels run in Triton's interpreter (fp32/fp16, tiny shapes); GPU tests are marked.
"""

import pytest
import torch

from kdaserve.ops.kda.conv import causal_conv_update_fwd, causal_conv_varlen_fwd
from kdaserve.ops.kda.reference import causal_conv_update, causal_conv_varlen
from kdaserve.ops.kda.types import conv_state_rows
from kdaserve.testing import assert_rel_close, assert_slots_untouched, make_kda_case, nan_poison, tolerance_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Lengths crossing the 32-token block, shorter than the state (history shifts in place), and 1.
LENS = [5, 1, 40, 2, 3]


def _varlen(case, x=None, **kw):
    return causal_conv_varlen_fwd(
        case.qkv if x is None else x, case.weights.conv_weight, case.conv_state, case.cu_seqlens,
        case.state_indices, case.has_initial_state, case.conv_layout, cu_seqlens_cpu=case.cu_seqlens_cpu, **kw,
    )


def _check_varlen_against_reference(case, y, ref, before):
    used = [s for s in case.state_indices.tolist() if s > 0]
    rows = torch.repeat_interleave(case.state_indices.cpu() > 0, torch.tensor(case.seq_lens)).to(y.device)
    ref_y = causal_conv_varlen(
        ref.qkv, ref.weights.conv_weight, ref.conv_state, ref.cu_seqlens, ref.state_indices, ref.has_initial_state,
        ref.conv_layout
    )
    assert_rel_close(y[rows], ref_y[rows].to(y.dtype), tolerance_for(y.dtype), "conv output")
    assert torch.equal(
        conv_state_rows(case.conv_state, case.conv_layout)[used], conv_state_rows(ref.conv_state, case.conv_layout)[used]
    ), "conv state differs from the reference"
    assert_slots_untouched(before, case.conv_state, used, "conv_state")


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_matches_reference(layout, dtype):
    # spec_tokens=2: a 5-row state, so prefill must use the newest W-1 rows, not the first ones.
    case = make_kda_case(LENS, H=2, D=16, dtype=dtype, conv_layout=layout, spec_tokens=2,
                         has_initial_state=[True, True, False, True, False], seed=3, device=DEV)
    case.state_indices[3] = 0  # a null sequence in the middle: skipped, reads and writes nothing
    ref, before = case.clone(), case.conv_state.clone()
    y = _varlen(case)
    assert y.dtype == dtype
    _check_varlen_against_reference(case, y, ref, before)


def test_varlen_negative_slot_and_plain_state():
    case = make_kda_case([3, 1, 4], H=1, D=16, conv_layout="SD", seed=4, device=DEV)
    case.state_indices[0] = -1
    ref, before = case.clone(), case.conv_state.clone()
    _check_varlen_against_reference(case, _varlen(case), ref, before)


def test_varlen_strided_equals_contiguous_bit_for_bit():
    case = make_kda_case([7, 33, 2], H=2, D=16, strided=True, seed=5, device=DEV)
    assert case.qkv.stride(0) != case.qkv.shape[1]  # really a column slice of the projection
    other = case.clone()
    y_strided = _varlen(case)
    y_contig = _varlen(other, x=other.qkv.contiguous())
    assert torch.equal(y_strided, y_contig)
    assert torch.equal(case.conv_state, other.conv_state)


def test_varlen_writes_into_out_view():
    case = make_kda_case([4, 9], H=1, D=16, seed=6, device=DEV)
    ref, before = case.clone(), case.conv_state.clone()
    buf = nan_poison(torch.empty(case.T, case.qkv.shape[1] + 8, device=DEV))
    out = buf[:, 4 : 4 + case.qkv.shape[1]]
    y = _varlen(case, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.isnan(buf[:, :4]).all() and torch.isnan(buf[:, -4:]).all()  # nothing outside the view
    _check_varlen_against_reference(case, out, ref, before)


def test_varlen_without_host_cu_seqlens_falls_back():
    case = make_kda_case([6, 2], H=1, D=16, seed=7, device=DEV)
    other = case.clone()
    y1 = _varlen(case)
    y2 = causal_conv_varlen_fwd(other.qkv, other.weights.conv_weight, other.conv_state, other.cu_seqlens,
                                other.state_indices, other.has_initial_state, other.conv_layout)
    assert torch.equal(y1, y2) and torch.equal(case.conv_state, other.conv_state)


def test_varlen_rejects_bad_inputs():
    case = make_kda_case([3], H=1, D=16, seed=8)
    with pytest.raises(ValueError, match="contiguous columns"):
        _varlen(case, x=case.qkv.t().contiguous().t())
    with pytest.raises(ValueError, match="conv weight"):
        causal_conv_varlen_fwd(case.qkv, case.weights.conv_weight[:-1], case.conv_state, case.cu_seqlens,
                               case.state_indices, case.has_initial_state)
    with pytest.raises(ValueError, match="conv_layout"):
        causal_conv_varlen_fwd(case.qkv, case.weights.conv_weight, case.conv_state, case.cu_seqlens,
                               case.state_indices, case.has_initial_state, "SDX")


def _check_update(case, accepted=None):
    """Kernel vs reference on one decode/verify step; x rows NaN-poisoned output; slots checked."""
    ref, before = case.clone(), case.conv_state.clone()
    out = nan_poison(torch.empty(case.qkv.shape, dtype=case.qkv.dtype, device=case.qkv.device))
    causal_conv_update_fwd(case.qkv, case.weights.conv_weight, case.conv_state, case.state_indices, accepted,
                           case.conv_layout, out=out)
    ref_y = causal_conv_update(ref.qkv, ref.weights.conv_weight, ref.conv_state, ref.state_indices, accepted, ref.conv_layout)
    m = case.T // case.N
    rows = (case.state_indices > 0).repeat_interleave(m)
    assert_rel_close(out[rows], ref_y[rows].to(out.dtype), tolerance_for(out.dtype), "conv update output")
    assert torch.isnan(out[~rows]).all(), "conv update wrote rows of a null sequence"
    used = [s for s in case.state_indices.tolist() if s > 0]
    assert torch.equal(
        conv_state_rows(case.conv_state, case.conv_layout)[used], conv_state_rows(ref.conv_state, case.conv_layout)[used]
    ), "conv state differs from the reference"
    assert_slots_untouched(before, case.conv_state, used, "conv_state")


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_update_decode_matches_reference(layout, dtype):
    case = make_kda_case([1] * 5, H=2, D=16, dtype=dtype, conv_layout=layout, seed=10, device=DEV)
    case.state_indices[2] = 0
    case.state_indices[4] = -1
    _check_update(case)


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_update_speculative_every_accept_count(layout):
    S = 3
    case = make_kda_case([S + 1] * 5, H=1, D=16, conv_layout=layout, spec_tokens=S, seed=11, device=DEV)
    case.state_indices[1] = 0
    accepted = torch.tensor([1, 2, 3, 4, 2], dtype=torch.int32, device=DEV)
    _check_update(case, accepted)


def test_update_decode_with_spec_sized_state():
    """Plain decode on a pool sized for drafts (L = W-1+S) shifts by one row and keeps L rows."""
    case = make_kda_case([1] * 3, H=1, D=16, spec_tokens=2, seed=12, device=DEV)
    _check_update(case)


def test_update_strided_equals_contiguous_bit_for_bit():
    case = make_kda_case([1] * 4, H=2, D=16, strided=True, seed=13, device=DEV)
    other = case.clone()
    y1 = causal_conv_update_fwd(case.qkv, case.weights.conv_weight, case.conv_state, case.state_indices)
    y2 = causal_conv_update_fwd(other.qkv.contiguous(), other.weights.conv_weight, other.conv_state, other.state_indices)
    assert torch.equal(y1, y2) and torch.equal(case.conv_state, other.conv_state)


def test_update_rejects_uneven_rows():
    case = make_kda_case([1] * 3, H=1, D=16, seed=14)
    with pytest.raises(ValueError, match="same count per sequence"):
        causal_conv_update_fwd(case.qkv, case.weights.conv_weight, case.conv_state, case.state_indices[:2])



@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_varlen_gpu_bf16_real_shape(layout):
    case = make_kda_case([1, 17, 300, 2048, 64], H=32, D=128, dtype=torch.bfloat16, conv_layout=layout,
                         spec_tokens=3, seed=9, device="cuda")
    case.state_indices[1] = 0
    ref, before = case.clone(), case.conv_state.clone()
    _check_varlen_against_reference(case, _varlen(case), ref, before)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("N,S", [(512, 0), (128, 3)])  # (the case builds a recurrent pool of N*(S+1) slots too)
def test_update_gpu_bf16_many_sequences(layout, N, S):
    case = make_kda_case([S + 1] * N, H=32, D=128, dtype=torch.bfloat16, conv_layout=layout, spec_tokens=S,
                         seed=15, device="cuda")
    case.state_indices[::7] = 0
    accepted = torch.randint(1, S + 2, (N,), dtype=torch.int32, device="cuda") if S else None
    _check_update(case, accepted)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_varlen_gpu_many_short_sequences_shift_history_in_place(layout):
    """Sequences shorter than the 6-row state move history rows within their slot: the state
    kernel's barrier must order every read before any write (a race shows up only on a GPU)."""
    g = torch.Generator().manual_seed(16)
    lens = torch.randint(1, 6, (256,), generator=g).tolist()
    case = make_kda_case(lens, H=32, D=128, dtype=torch.bfloat16, conv_layout=layout, spec_tokens=3,
                         has_initial_state=True, seed=17, device="cuda")
    ref, before = case.clone(), case.conv_state.clone()
    _check_varlen_against_reference(case, _varlen(case), ref, before)
