"""SwiGLU's activation on merged gate|up rows (the dense MLP's and the shared experts' GEMM output):

    y = round(silu(gate) * up)          fp32 math, one rounding to the input's dtype
    with a limit (GLM-5.3-Flash's clamped SwiGLU): gate = min(gate, limit), up = clamp(up, +-limit)

the definition is layers/mlp.SwiGLUMLP's torch path (which rounds silu(gate) before the product:
within one rounding of this). One launch where the torch path takes two (silu, product), four
with the clamps: in a CUDA-graph decode step of Kimi-Linear that is 27 kernels fewer.

Rows may be strided (the last dim contiguous): row t holds gate in columns [0, I), up in [I, 2I).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat


@triton.jit
def silu_product(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """silu(gate) * up in fp32, the clamps first where HAS_LIMIT: this kernel's and the fused MoE
    gate_up kernel's epilogue (ops/moe/fused.py)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def swiglu_kernel(x_ptr, stride_x, y_ptr, stride_y, n_rows, I, limit,
                  HAS_LIMIT: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    src = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    y = silu_product(gate, up, limit, HAS_LIMIT)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_shape(I: int) -> tuple[int, int]:
    """(rows per program, columns per program): ~4K outputs per program."""
    BI = min(1024, triton.next_power_of_2(max(I, 16)))
    return max(1, 4096 // BI), BI


def swiglu_fwd(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I] in gate_up's dtype."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"SwiGLU takes merged gate|up rows of even width, got {two_i}")
    I = two_i // 2
    interpreter_compat.install()
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    x = x.reshape(-1, two_i)
    y = torch.empty(x.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    n = x.shape[0]
    if n:
        BR, BI = launch_shape(I)
        swiglu_kernel[(triton.cdiv(n, BR), triton.cdiv(I, BI))](
            x, x.stride(0), y, y.stride(0), n, I, float(limit or 0.0),
            HAS_LIMIT=limit is not None, BR=BR, BI=BI, num_warps=4,
        )
    return y.view(*gate_up.shape[:-1], I)


def swiglu_reference(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """The torch definition (layers/mlp.SwiGLUMLP's path, and the MoE reference's per expert)."""
    import torch.nn.functional as F

    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up
