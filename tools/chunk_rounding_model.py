"""A torch model of the chunk backend's rounding, to measure how its error behaves with length.

The interpreter cannot run bf16 dots and takes ~0.5 s per (chunk, head) program, so long sequences
cannot be checked on CPU through the kernels. This model follows the kernels' math chunk by chunk
and rounds exactly where they store or feed tensor cores (docs/chunk-prefill.md, "Numerics"):

    y (conv output)                      fp16   (conv math fp32 from bf16 inputs)
    A, Aqk products                      tf32 operands (10-bit mantissa), fp32 accumulation
    (I + A)^-1                           fp32 (--inverse fp32, intra.py's substitution), or recursive
                                         blocking with tf32 operands (--inverse tf32: one 64x64
                                         blocking; the "blocked" kernel blocks only inside the
                                         16x16 diagonal blocks and forms the others by block
                                         substitution: tf32 roundings of the same size, in a
                                         different order, so a model, not a replica)
    w, u (tf32 products), kg, qg, Aqk    fp16
    h = S^T (stored, and the w S^T operand), v_new      fp16
    S                                    fp32 for the whole sequence, never re-rounded
    output                               gated RMSNorm in fp32, rounded to bf16

and compares it with the fp64 chunked reference on one long sequence resuming from a random state.
At 8K it reproduces the GPU's measured errors (out 1.8e-3, state 7e-4 relative RMS), and it stays
flat up to 128K for both gates, slow-decay heads included:

    python -m tools.chunk_rounding_model --gate bounded --lengths 8192 131072   # ~2 min, CPU
"""

from __future__ import annotations

import argparse
import time

import torch

from kdaserve.ops.reference.chunked import chunk_forward
from kdaserve.ops.reference.conv import causal_conv_varlen
from kdaserve.ops.reference.gates import beta_sigmoid, kda_gate, l2norm_qk
from kdaserve.ops.reference.norm import gated_rms_norm
from kdaserve.testing import make_kda_case, rel_rms

CHUNK = 64


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to tf32's 10-bit mantissa (to nearest; ties away, close enough for a model)."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _inverse_tf32_blocked(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 of strictly lower [.., C, C] A by recursive blocking on 16-bit inputs:
    T_2b = T_b - T_b A_off T_b, every dot with tf32 operands (the inner product rounded again as
    the outer dot's operand) and fp32 accumulation."""
    C = A.shape[-1]
    r = torch.arange(C)
    ri, ci = r[:, None], r[None, :]
    T = torch.eye(C) - torch.where(ri // 2 == ci // 2, A, torch.zeros(()))
    b = 2
    while b < C:
        off = torch.where((ri // (2 * b) == ci // (2 * b)) & (ri // b != ci // b), A, torch.zeros(()))
        T = T - _tf32(_tf32(T) @ _tf32(off)) @ _tf32(T)
        b *= 2
    return T


def _inputs(case, dt: torch.dtype, round_y):
    """Head-first q (scaled), k (normalized), v, gk, beta of a single-sequence case in dtype dt."""
    H, D = case.H, case.D
    y = causal_conv_varlen(case.qkv.to(dt), case.weights.conv_weight, case.conv_state.to(dt, copy=True),
                           case.cu_seqlens, case.state_indices, case.has_initial_state, case.conv_layout)
    y = round_y(y)
    T = y.shape[0]
    q, k, v = y.view(T, 3, H, D).unbind(1)
    q, k = l2norm_qk(q, k)
    gk = kda_gate(case.g1.to(dt).reshape(T, H, D), case.weights.A_log, case.weights.dt_bias, case.weights.lower_bound)
    beta = beta_sigmoid(case.beta_logits.to(dt))
    return tuple(x.transpose(0, 1) for x in (q, k, v.to(dt), gk, beta))  # [T, H, ...] -> [H, T, ...]


def reference_fp64(case):
    """(o [T, H, D], final state [H, V, K]) of the chunk-64 reference in fp64."""
    q, k, v, gk, beta = _inputs(case, torch.float64, lambda y: y)
    S = case.recurrent_state[int(case.state_indices[0])].double()
    o = torch.empty_like(v)
    for c0 in range(0, v.shape[1], CHUNK):
        s = slice(c0, c0 + CHUNK)
        o[:, s], S = chunk_forward(S, q[:, s], k[:, s], v[:, s], gk[:, s], beta[:, s])
    return o.transpose(0, 1), S


def kernel_model(case, inverse: str = "tf32"):
    """(o, final state) with the kernels' rounding points (see the module docstring)."""
    q, k, v, gk, beta = _inputs(case, torch.float32, _fp16)
    St = case.recurrent_state[int(case.state_indices[0])].float().transpose(1, 2).clone()  # [H, K, V]
    o = torch.empty_like(v)
    eye = torch.eye(CHUNK)
    for c0 in range(0, v.shape[1], CHUNK):
        s = slice(c0, c0 + CHUNK)
        qc, kc, vc, b = q[:, s], k[:, s], v[:, s], beta[:, s]
        C = qc.shape[1]
        g = gk[:, s].cumsum(1)
        causal = torch.ones(C, C, dtype=torch.bool).tril()
        diff = g[:, :, None, :] - g[:, None, :, :]
        decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, -torch.inf)).exp()
        right = _tf32(kc[:, None, :, :].expand_as(decay))
        Akk = torch.einsum("htic,htic->hti", _tf32(kc[:, :, None, :] * decay), right)
        Aqk = _fp16(torch.einsum("htic,htic->hti", _tf32(qc[:, :, None, :] * decay), right))
        A = (Akk * b[:, :, None]).tril(-1)
        if inverse == "tf32":
            X = _tf32(_inverse_tf32_blocked(A))
        else:
            X = _tf32(torch.linalg.solve_triangular(eye[:C, :C] + A, eye[:C, :C].expand_as(A), upper=False,
                                                    unitriangular=True))
        w = _fp16(X @ _tf32(b[..., None] * kc * g.exp()))
        u = _fp16(X @ _tf32(b[..., None] * vc))
        kg = _fp16(kc * (g[:, -1:] - g).exp())
        qg = _fp16(qc * g.exp())
        h = _fp16(St)
        v_new = _fp16(u - w @ h)
        o[:, s] = qg @ h + Aqk @ v_new
        St = St * g[:, -1:].exp().transpose(1, 2) + kg.transpose(1, 2) @ v_new
    return o.transpose(0, 1), St.transpose(1, 2)


def measure(T: int, gate: str, H: int, D: int, slow: int, seed: int = 15, inverse: str = "tf32") -> dict:
    case = make_kda_case([T], H=H, D=D, dtype=torch.bfloat16, gate=gate, slow_decay_heads=slow,
                         conv_dtype=torch.bfloat16, has_initial_state=True, seed=seed)
    o_ref, S_ref = reference_fp64(case)
    o_mod, S_mod = kernel_model(case, inverse)
    g2, wn = case.g2.reshape(T, H, D), case.weights.norm_weight
    y_ref = gated_rms_norm(o_ref, g2.double(), wn, case.weights.norm_eps)
    y_mod = gated_rms_norm(o_mod, g2.float(), wn, case.weights.norm_eps).bfloat16()
    sh, tail = slice(H - slow, H), slice(T - T // 4, T)
    return {
        "out": rel_rms(y_mod, y_ref), "out slow heads": rel_rms(y_mod[:, sh], y_ref[:, sh]),
        "out slow, last quarter": rel_rms(y_mod[tail, sh], y_ref[tail, sh]),
        "state": rel_rms(S_mod, S_ref), "state slow heads": rel_rms(S_mod[sh], S_ref[sh]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gate", default="bounded", choices=["bounded", "unbounded"])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--slow", type=int, default=2, help="slow-decay heads among --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--inverse", default="tf32", choices=["tf32", "fp32"], help="the chunk inverse's arithmetic")
    a = p.parse_args()
    rows = []
    for T in a.lengths:
        t = time.time()
        rows.append((T, measure(T, a.gate, a.heads, a.head_dim, a.slow, inverse=a.inverse), time.time() - t))
    keys = list(rows[0][1])
    print(f"{a.gate} gate, H={a.heads} ({a.slow} slow), D={a.head_dim}, {a.inverse} inverse: relative RMS error vs fp64")
    print(f"{'T':>7} | " + " | ".join(f"{k:>22}" for k in keys) + " | seconds")
    for T, m, s in rows:
        print(f"{T:>7} | " + " | ".join(f"{m[k]:>22.2e}" for k in keys) + f" | {s:.0f}")


if __name__ == "__main__":
    main()
