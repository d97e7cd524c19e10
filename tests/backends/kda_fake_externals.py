"""Torch stand-ins for the external KDA entry points our adapters call (flash-linear-attention
0.6.0, FlashKDA, AMD AITER), so the adapters' glue (state gather/scatter, padding, speculative
slots, layouts, argument conventions) is tested on the CPU.

Each stand-in follows the documented API and checks what the real kernel assumes but does not
check (contiguity its pointer arithmetic relies on, dtypes, shapes), so an adapter that would feed
the real kernel garbage fails here. The math is the reference's, in fp32.
"""

from __future__ import annotations

import sys
import types

import torch

from kdaserve.ops.kda.reference.gates import kda_gate, l2norm
from kdaserve.ops.kda.reference.norm import gated_rms_norm
from kdaserve.ops.kda.reference.recurrence import delta_rule_step


def _prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale):
    """Per-token fp32 inputs of the delta rule from raw kernel inputs [..., H, K]."""
    H, K = q.shape[-2:]
    qn = l2norm(q.float()) * (K**-0.5 if scale is None else scale)
    kn = l2norm(k.float())
    gk = kda_gate(g.float().reshape(-1, H, K), A_log.reshape(H), dt_bias.reshape(H, K), lower_bound).view(g.shape)
    return qn, kn, v.float(), gk, torch.sigmoid(beta.float())


def _run(S, q, k, v, gk, beta):
    outs = []
    for t in range(q.shape[0]):
        S, o = delta_rule_step(S, q[t], k[t], v[t], gk[t], beta[t])
        outs.append(o)
    return S, torch.stack(outs) if outs else v.new_zeros(v.shape)


# ---- flash-linear-attention 0.6.0 -----------------------------------------------------------------


def fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel and state_v_first
    assert safe_gate == (lower_bound is not None), "bounded gate <=> safe_gate with lower_bound"
    assert q.shape[0] == 1 and cu_seqlens is not None and cu_seqlens.dtype == torch.long
    assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    N = len(cu_seqlens) - 1
    assert initial_state is not None and initial_state.dtype == torch.float32, "initial_state must be in float32."
    assert initial_state.shape == (N, q.shape[2], v.shape[3], q.shape[3])
    qn, kn, vf, gk, b = _prep(q[0], k[0], v[0], g[0], beta[0], kwargs["A_log"], kwargs["dt_bias"], lower_bound, scale)
    o = torch.zeros_like(vf)
    final = torch.empty_like(initial_state)
    cu = cu_seqlens_cpu.tolist()
    for n in range(N):
        s = slice(cu[n], cu[n + 1])
        final[n], o[s] = _run(initial_state[n].clone(), qn[s], kn[s], vf[s], gk[s], b[s])
    return o.to(v.dtype)[None], final if output_final_state else None


def fla_fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                                ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                                use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                lower_bound=None, out=None, **kwargs):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert t.is_contiguous(), f"the FLA kernel indexes {name} as contiguous"
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel and state_v_first
    assert inplace_final_state and cu_seqlens is None and ssm_state_indices is not None
    B, T = q.shape[:2]
    flat = ssm_state_indices.reshape(-1).tolist()
    stride = ssm_state_indices.stride(0) if ssm_state_indices.dim() == 2 else 1
    qn, kn, vf, gk, b = _prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    o = torch.zeros_like(vf)
    for n in range(B):
        i0 = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        assert 0 <= i0 < (T if num_accepted_tokens is not None else 1), "the kernel would read a slot outside the row"
        S = initial_state[flat[n * stride + i0]].float()
        for t in range(T):
            S, o[n, t] = delta_rule_step(S, qn[n, t], kn[n, t], vf[n, t], gk[n, t], b[n, t])
            initial_state[flat[n * stride + t]] = S.to(initial_state.dtype)
    return o.to(v.dtype), initial_state


def fla_rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False):
    assert activation == "sigmoid" and bias is None and residual is None
    return gated_rms_norm(x, g, weight, eps).to(x.dtype)


# ---- FlashKDA ---------------------------------------------------------------------------------


def flash_kda_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
                  cu_seqlens=None):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        assert t.dtype == torch.bfloat16 and t.is_contiguous(), f"FlashKDA needs contiguous bf16 {name}"
    assert q.shape[-1] == 128 and v.shape[-1] == 128, "FlashKDA requires K = V = 128"
    assert A_log.dtype == torch.float32 and dt_bias.dtype == torch.float32 and dt_bias.shape == (q.shape[2], 128)
    assert -5.0 <= lower_bound <= 0 and cu_seqlens.dtype == torch.int64 and q.shape[0] == 1
    N = cu_seqlens.numel() - 1
    assert initial_state.dtype == final_state.dtype and initial_state.shape == final_state.shape == (N, q.shape[2], 128, 128)
    qn, kn, vf, gk, b = _prep(q[0], k[0], v[0], g[0], beta[0], A_log, dt_bias, lower_bound, scale)
    cu = cu_seqlens.tolist()
    for n in range(N):
        s = slice(cu[n], cu[n + 1])
        S, o = _run(initial_state[n].float(), qn[s], kn[s], vf[s], gk[s], b[s])
        out[0, s] = o.to(out.dtype)
        final_state[n] = S.to(final_state.dtype)


# ---- AMD AITER --------------------------------------------------------------------------------


def _dense_heads(name, t, D):
    assert t.stride()[2:] == (D, 1), f"AITER needs {name} dense in [H, {D}], got strides {t.stride()}"


def aiter_chunk_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices=None, chunk_offsets=None,
                    scale=None, out=None, initial_state=None, output_final_state=False, state_cache=None,
                    state_indices=None, has_initial_state=None, out_gate=None, norm_weight=None, norm_eps=1e-5, config=None):
    _, T, H, K = q.shape
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        _dense_heads(name, t, K)
        assert t.stride(1) % 8 == 0, f"{name} rows must be 16-byte aligned"
    assert beta.shape == (1, T, H) and beta.stride(2) == 1
    assert A_log.is_contiguous() and A_log.numel() == H and dt_bias.is_contiguous() and dt_bias.numel() == H * K
    assert -5.5 <= lower_bound < 0 and cu_seqlens.is_contiguous()
    counts = ((cu_seqlens[1:] - cu_seqlens[:-1]) + 63) // 64
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts.cpu())
    expect_ci = torch.stack([seq, torch.arange(seq.numel()) - offsets.cpu()[seq]], 1).int()
    assert torch.equal(chunk_indices.cpu(), expect_ci) and torch.equal(chunk_offsets.cpu().long(), offsets.cpu())
    assert state_cache is None and initial_state.dtype == torch.float32 and initial_state.is_contiguous()
    N = cu_seqlens.numel() - 1
    qn, kn, vf, gk, b = _prep(q[0], k[0], v[0], g[0], beta[0], A_log, dt_bias, lower_bound, scale)
    final = initial_state.new_empty(initial_state.shape)
    cu = cu_seqlens.tolist()
    for n in range(N):
        s = slice(cu[n], cu[n + 1])
        final[n], o = _run(initial_state[n].clone(), qn[s], kn[s], vf[s], gk[s], b[s])
        out[0, s] = o.to(out.dtype)
    return out, final if output_final_state else None


def aiter_fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                              output_final_state=True, inplace_final_state=True, state_v_first=None, cu_seqlens=None,
                              ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                              use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                              lower_bound=None, out=None, state_out=None, cache_state_updates=False, pad_slot_guard=False,
                              config=None, conv_state=None, conv_weight=None, out_gate=None, norm_weight=None, norm_eps=1e-5):
    B, T, H, K = q.shape
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        _dense_heads(name, t, K)
    assert beta.stride(2) == 1
    if B > 1:
        for t in (q, k, v, g, beta):
            assert t.stride(0) == T * t.stride(1), "batches must be token-major"
    assert A_log.numel() == H and dt_bias.numel() == H * K and dt_bias.is_contiguous()
    assert initial_state.dtype == torch.float32 and inplace_final_state and state_v_first and pad_slot_guard
    assert ssm_state_indices.stride(-1) == 1 and (num_accepted_tokens is None or num_accepted_tokens.is_contiguous())
    rows = ssm_state_indices.view(B, -1).tolist()
    qn, kn, vf, gk, b = _prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    for n in range(B):
        first = rows[n][int(num_accepted_tokens[n]) - 1] if num_accepted_tokens is not None else rows[n][0]
        if first <= 0 or rows[n][0] <= 0:  # pad_slot_guard: a padded sequence reads and writes nothing
            continue
        S = initial_state[first].clone()
        for t in range(T):
            S, o = delta_rule_step(S, qn[n, t], kn[n, t], vf[n, t], gk[n, t], b[n, t])
            out[n, t] = o.to(out.dtype)
            slot = rows[n][t] if num_accepted_tokens is not None else rows[n][0]
            if slot > 0:
                initial_state[slot] = S
    return out, initial_state


# ---- installing them ----------------------------------------------------------------------------


def _modules(tree: dict[str, dict]) -> dict[str, types.ModuleType]:
    mods = {}
    for name, attrs in tree.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m
    for name, m in mods.items():  # parent.child attributes, like a real package
        parent, _, child = name.rpartition(".")
        if parent in mods:
            setattr(mods[parent], child, m)
    return mods


FAKES = {
    "fla": _modules({
        "fla": {}, "fla.ops": {}, "fla.ops.kda": {"chunk_kda": fla_chunk_kda},
        "fla.ops.kda.fused_recurrent": {"fused_recurrent_kda_fwd": fla_fused_recurrent_kda_fwd},
        "fla.modules": {}, "fla.modules.norm": {}, "fla.modules.norm.fused_norm_gate": {"rms_norm_gated": fla_rms_norm_gated},
    }),
    "flash_kda": _modules({"flash_kda": {"fwd": flash_kda_fwd}}),
    "aiter": _modules({
        "aiter": {}, "aiter.ops": {}, "aiter.ops.triton": {}, "aiter.ops.triton.attention": {},
        "aiter.ops.triton.attention.chunk_kda": {"chunk_kda": aiter_chunk_kda},
        "aiter.ops.triton.attention.kda": {"fused_recurrent_kda": aiter_fused_recurrent_kda},
    }),
}


def install(monkeypatch, package: str) -> None:
    """Put the stand-in modules of `package` in sys.modules for one test."""
    for name, module in FAKES[package].items():
        monkeypatch.setitem(sys.modules, name, module)
