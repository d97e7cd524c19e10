"""Triton KDA recurrence (decode and speculative verify) against the torch token loop."""

import pytest
import torch

from kdaserve.ops.kda.recurrent import kda_recurrent_fwd
from kdaserve.ops.kda.reference import beta_sigmoid, kda_gate, kda_qkv_prepare, kda_recurrent_spec, kda_recurrent_varlen
from kdaserve.testing import assert_rel_close, assert_slots_untouched, make_kda_case, nan_poison, tolerance_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(case, y, spec=None, accepted=None):
    """(o, pool after) of the fp64 token loop from the same conv output y and pool."""
    H, D, T, N = case.H, case.D, case.T, case.N
    pool = case.recurrent_state.double()
    q, k, v = kda_qkv_prepare(y.double(), H, D)
    w = case.weights
    gk = kda_gate(case.forget_logits.double().reshape(T, H, D), w.A_log, w.dt_bias, w.lower_bound)
    beta = beta_sigmoid(case.beta_logits.double())
    if spec is None:
        cu = torch.arange(N + 1, dtype=torch.int32, device=y.device)
        ones = torch.ones(N, dtype=torch.bool, device=y.device)
        o = kda_recurrent_varlen(q, k, v, gk, beta, pool, cu, case.state_indices, ones)
    else:
        o = kda_recurrent_spec(q, k, v, gk, beta, pool, spec, accepted)
    return o, pool


def _conv_output(case, dtype):
    g = torch.Generator().manual_seed(123)
    return torch.nn.functional.silu(torch.randn(case.qkv.shape, generator=g)).to(dtype).to(case.qkv.device)


def _check(case, y, spec=None, accepted=None, out_dtype=torch.float32):
    ref_o, ref_pool = _reference(case, y, spec, accepted)
    before = case.recurrent_state.clone()
    out = nan_poison(torch.empty(case.T, case.H, case.D, dtype=out_dtype, device=y.device))
    if spec is None:
        kda_recurrent_fwd(y, case.forget_logits, case.beta_logits, case.recurrent_state, case.weights, out,
                          state_indices=case.state_indices)
        rows = case.state_indices > 0
        used = [s for s in case.state_indices.tolist() if s > 0]
    else:
        kda_recurrent_fwd(y, case.forget_logits, case.beta_logits, case.recurrent_state, case.weights, out,
                          spec_state_indices=spec, num_accepted_tokens=accepted)
        rows = (spec[:, :1] > 0).expand(spec.shape).reshape(-1)
        used = [s for r in spec.tolist() if r[0] > 0 for s in r if s > 0]
    tol = tolerance_for(y.dtype, case.recurrent_state.dtype)
    assert_rel_close(out[rows], ref_o[rows], tol, "recurrent output")
    assert torch.isnan(out[~rows]).all(), "padding rows of out were written"
    assert_rel_close(case.recurrent_state[used], ref_pool[used], tol, "recurrent state")
    assert_slots_untouched(before, case.recurrent_state, used, "recurrent_state")


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("dtype,D", [(torch.float32, 16), (torch.float16, 32)])
def test_decode_matches_reference(gate, dtype, D):
    case = make_kda_case([1] * 4, H=2, D=D, dtype=dtype, gate=gate, slow_decay_heads=1, seed=20, device=DEV)
    case.state_indices[1] = 0
    case.state_indices[3] = -2
    _check(case, _conv_output(case, dtype))


def test_decode_bf16_state():
    case = make_kda_case([1] * 3, H=2, D=16, state_dtype=torch.bfloat16, seed=21, device=DEV)
    _check(case, _conv_output(case, torch.float32))


def test_decode_flat_gate_and_strided_beta():
    """forget_logits as [T, P], beta a column slice of the projection (strided), out in fp16."""
    case = make_kda_case([1] * 3, H=2, D=16, strided=True, seed=22, device=DEV)
    assert case.beta_logits.stride(0) != case.H
    case.forget_logits = case.forget_logits.reshape(case.T, -1)
    ref_case = case.clone()
    y = _conv_output(case, torch.float32)
    out_a = nan_poison(torch.empty(case.T, case.H, case.D, device=DEV))
    out_b = nan_poison(torch.empty(case.T, case.H, case.D, device=DEV))
    kda_recurrent_fwd(y, case.forget_logits, case.beta_logits, case.recurrent_state, case.weights, out_a,
                      state_indices=case.state_indices)
    kda_recurrent_fwd(y, ref_case.forget_logits.reshape(case.T, case.H, case.D).contiguous(), ref_case.beta_logits.contiguous(),
                      ref_case.recurrent_state, ref_case.weights, out_b, state_indices=ref_case.state_indices)
    assert torch.equal(out_a, out_b) and torch.equal(case.recurrent_state, ref_case.recurrent_state)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_speculative_per_token_slots(state_dtype):
    S, N = 2, 4
    case = make_kda_case([S + 1] * N, H=2, D=16, spec_tokens=S, state_dtype=state_dtype, seed=23, device=DEV)
    free = [s for s in range(1, case.recurrent_state.shape[0])]
    spec = torch.tensor(free[: N * (S + 1)], dtype=torch.int32, device=DEV).view(N, S + 1)
    spec[2, 0] = 0           # padding row: first slot null, whole row skipped
    spec[3, 1] = 0           # a null draft slot inside a live row: that state is not stored
    accepted = torch.tensor([1, 3, 2, 2], dtype=torch.int32, device=DEV)
    _check(case, _conv_output(case, torch.float32), spec, accepted)


def test_block_v_choices_agree():
    """Every V-tiling computes the same numbers (per-row math does not depend on the tile)."""
    case = make_kda_case([1] * 2, H=1, D=32, seed=24, device=DEV)
    y = _conv_output(case, torch.float32)
    outs = []
    for bv in (8, 16, 32):
        c = case.clone()
        out = nan_poison(torch.empty(c.T, c.H, c.D, device=DEV))
        kda_recurrent_fwd(y, c.forget_logits, c.beta_logits, c.recurrent_state, c.weights, out, state_indices=c.state_indices,
                          block_v=bv)
        outs.append((out, c.recurrent_state))
    for out, pool in outs[1:]:
        assert_rel_close(out, outs[0][0], 1e-6, "output across block_v")
        assert_rel_close(pool, outs[0][1], 1e-6, "state across block_v")


def test_rejects_bad_inputs():
    case = make_kda_case([1] * 2, H=1, D=16, seed=25)
    y = _conv_output(case, torch.float32)
    out = torch.empty(2, 1, 16)
    with pytest.raises(ValueError, match="one token per sequence"):
        kda_recurrent_fwd(y, case.forget_logits, case.beta_logits, case.recurrent_state, case.weights, out,
                          state_indices=case.state_indices[:1])
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        kda_recurrent_fwd(y, case.forget_logits, case.beta_logits, case.recurrent_state, case.weights, out,
                          spec_state_indices=case.state_indices.view(2, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("N", [1, 64, 512])
def test_gpu_decode_bf16(state_dtype, gate, N):
    case = make_kda_case([1] * N, H=32, D=128, dtype=torch.bfloat16, state_dtype=state_dtype, gate=gate,
                         slow_decay_heads=8, seed=26, device="cuda")
    case.state_indices[::5] = 0
    _check(case, _conv_output(case, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_speculative_bf16(state_dtype):
    S, N = 3, 128
    case = make_kda_case([S + 1] * N, H=32, D=128, dtype=torch.bfloat16, spec_tokens=S, state_dtype=state_dtype,
                         slow_decay_heads=8, seed=27, device="cuda")
    spec = (torch.randperm(case.recurrent_state.shape[0] - 1)[: N * (S + 1)] + 1).to(torch.int32).view(N, S + 1).cuda()
    spec[::9, 0] = 0
    accepted = torch.randint(1, S + 2, (N,), dtype=torch.int32, device="cuda")
    _check(case, _conv_output(case, torch.bfloat16), spec, accepted)
