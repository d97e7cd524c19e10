"""The elementwise pieces and the conv, checked against independent formulations."""

import pytest
import torch
import torch.nn.functional as F

from kdaserve.ops.kda.reference import beta_sigmoid, causal_conv_varlen, gated_rms_norm, kda_gate, l2norm_qk
from kdaserve.ops.kda.reference.conv import causal_conv_update


def test_l2norm_scale_on_q_only():
    q, k = torch.randn(5, 3, 16, dtype=torch.float64), torch.randn(5, 3, 16, dtype=torch.float64)
    qn, kn = l2norm_qk(q, k)
    torch.testing.assert_close(kn.norm(dim=-1), torch.ones(5, 3, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(qn.norm(dim=-1), torch.full((5, 3), 16**-0.5, dtype=torch.float64), rtol=1e-6, atol=0)
    # eps sits inside the square root: a zero vector stays zero, not NaN
    assert torch.equal(l2norm_qk(torch.zeros(1, 16), torch.zeros(1, 16))[1], torch.zeros(1, 16))


def test_bounded_gate_formula_and_range():
    forget_logits, A_log, dt = torch.randn(7, 3, 8) * 4, torch.randn(3), torch.randn(3, 8)
    gk = kda_gate(forget_logits, A_log, dt, lower_bound=-5.0)
    expect = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (forget_logits + dt))
    torch.testing.assert_close(gk, expect)
    assert (gk <= 0).all() and (gk >= -5.0).all()
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(forget_logits, A_log, dt, lower_bound=-6.0)


def test_bounded_gate_reaches_both_ends_of_its_range_in_fp32():
    # In exact math LB * sigmoid(x) lies in (LB, 0); in fp32 sigmoid rounds to 1 above x ~ 17 and
    # underflows to 0 below x ~ -104, so the computed gate spans the closed [LB, 0]: -0.0 is the
    # correctly rounded "no decay" (exp(gk) = 1), LB the strongest decay. The contract says so.
    logits = torch.tensor([[[-200.0, -90.0, 0.0, 20.0, 200.0]]])
    gk = kda_gate(logits, torch.zeros(1), torch.zeros(1, 5), lower_bound=-5.0)
    assert gk[0, 0, 0].item() == 0.0 and gk[0, 0, -1].item() == -5.0
    assert (gk <= 0).all() and (gk >= -5.0).all() and torch.isfinite(gk).all()
    assert gk[0, 0, 2].item() == -2.5


def test_unbounded_gate_is_softplus_linear_above_20():
    forget_logits = torch.tensor([[[30.0, -30.0, 0.0]]])
    gk = kda_gate(forget_logits, torch.zeros(1), torch.zeros(1, 3), lower_bound=None)
    torch.testing.assert_close(gk, -torch.tensor([[[30.0, F.softplus(torch.tensor(-30.0)).item(), 0.6931472]]]))


def test_beta_and_norm_run_in_fp32():
    assert beta_sigmoid(torch.zeros(2, dtype=torch.float16)).dtype == torch.float32
    o, output_gate_logits, w = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(8)
    y = gated_rms_norm(o.half(), output_gate_logits.half(), w)
    assert y.dtype == torch.float32
    rms = (o.half().float().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    ref = o.half().float() / rms * w * torch.sigmoid(output_gate_logits.half().float())
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_varlen_conv_matches_conv1d(layout):
    """Against torch's conv1d on each sequence with its history prepended (or zero padding)."""
    C, W, lens = 6, 4, [5, 1, 9]
    x = torch.randn(sum(lens), C, dtype=torch.float64)
    w = torch.randn(C, W, dtype=torch.float64)
    pool = torch.randn(4, W - 1, C, dtype=torch.float64)
    state = pool.clone() if layout == "SD" else pool.transpose(1, 2).contiguous()
    cu = torch.tensor([0, 5, 6, 15])
    idx, his = torch.tensor([3, 1, 2]), torch.tensor([True, False, True])
    y = causal_conv_varlen(x, w, state, cu, idx, his, layout)
    for n in range(3):
        xs = x[cu[n] : cu[n + 1]]
        hist = pool[idx[n]] if his[n] else torch.zeros(W - 1, C, dtype=torch.float64)
        full = torch.cat([hist, xs]).T[None]  # [1, C, W-1+m]
        ref = F.silu(F.conv1d(full, w[:, None, :], groups=C))[0].T
        torch.testing.assert_close(y[cu[n] : cu[n + 1]], ref)
        rows = state[idx[n]] if layout == "SD" else state[idx[n]].T
        torch.testing.assert_close(rows, torch.cat([hist, xs])[-(W - 1) :])
    assert torch.equal(state[0], pool[0] if layout == "SD" else pool[0].T)  # slot 0 untouched


def test_conv_update_equals_varlen_of_one_token():
    C, W = 5, 4
    x = torch.randn(3, C, dtype=torch.float64)
    w = torch.randn(C, W, dtype=torch.float64)
    pool = torch.randn(5, W - 1, C, dtype=torch.float64)
    p1, p2 = pool.clone(), pool.clone()
    idx = torch.tensor([4, 2, 1])
    y1 = causal_conv_update(x, w, p1, idx)
    y2 = causal_conv_varlen(x, w, p2, torch.arange(4), idx, torch.ones(3, dtype=torch.bool))
    assert torch.equal(y1, y2) and torch.equal(p1, p2)
