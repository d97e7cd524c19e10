"""The expert computation in plain torch, the definition the fused path is judged by:

    out[t] = sum_j weights[t, j] * W2[e] (silu(W1[e] x_t) * W3[e] x_t),   e = ids[t, j]

with W1|W3 stacked as `w13 [E, 2I, hidden]` and W2 as `w2 [E, hidden, I]`. `activation_limit`
(GLM's clamped SwiGLU) clamps the gate from above and the up projection both ways first. Math in
fp32 for fp32 inputs, else in the input dtype with fp32 accumulation of the weighted sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.ops.activation.swiglu import swiglu_reference as swiglu


def moe_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                          ids: torch.Tensor, activation_limit: float | None = None, skip_expert: bool = False) -> torch.Tensor:
    """x [T, hidden], weights/ids [T, k] -> [T, hidden] in x's dtype. 4-bit experts
    (ops/fp4/weights.Fp4Weights) are dequantized into x's dtype, each expert as it is used.
    `skip_expert`: id E (one past the experts) marks choices computed elsewhere (another rank's
    experts under expert parallelism): they add nothing."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    for e in flat_ids.unique().tolist():
        if skip_expert and e == w13.shape[0]:
            continue
        slots = (flat_ids == e).nonzero().squeeze(1)
        tokens = slots // k
        h = swiglu(F.linear(x[tokens], _expert(w13, e, x.dtype)), activation_limit)
        y = F.linear(h, _expert(w2, e, x.dtype)).float() * weights.reshape(-1)[slots, None].float()
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def _expert(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    from kdaserve.ops.fp4.weights import Fp4Weights

    return w[e].dequantized(dtype) if isinstance(w, Fp4Weights) else w[e]


def moe_experts_fp8_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                              ids: torch.Tensor, activation_limit: float | None, w13_scale: torch.Tensor,
                              w2_scale: torch.Tensor, block: tuple[int, int], skip_expert: bool = False) -> torch.Tensor:
    """FP8 block-scaled experts as the fused path computes them: x quantized per token and group
    of block[1] columns, the SiLU product rounded to x's dtype and quantized the same way, weights
    dequantized (ops/fp8/reference.py); sums in fp32."""
    from kdaserve.ops.fp8.reference import dequantize_blocks, quantize_per_token_group_reference

    def rounded(t: torch.Tensor) -> torch.Tensor:   # quantize per token group, back to fp32
        q, s = quantize_per_token_group_reference(t, block[1])
        return dequantize_blocks(q, s, (1, block[1]))

    W13, W2 = dequantize_blocks(w13, w13_scale, block), dequantize_blocks(w2, w2_scale, block)
    T, k = ids.shape
    xd = rounded(x)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    for e in flat_ids.unique().tolist():
        if skip_expert and e == w13.shape[0]:
            continue
        slots = (flat_ids == e).nonzero().squeeze(1)
        tokens = slots // k
        h = swiglu(xd[tokens] @ W13[e].T, activation_limit).to(x.dtype)
        y = (rounded(h) @ W2[e].T) * weights.reshape(-1)[slots, None].float()
        out.index_add_(0, tokens, y.to(x.dtype).float() if x.dtype != torch.float32 else y)
    return out.to(x.dtype)
