"""`flash`: the fast KDA prefill backend (Triton), built to beat FlashKDA. Design: docs/flash-prefill.md.

Two kernels do the work: a token-parallel prepare pass over 32-token chunks (conv + SiLU, l2norm,
gate, beta and the chunk's WY factors on tensor cores, written to a compact fp16 workspace) and a
recurrence per (sequence, head) holding the fp32 state in registers, with the gated RMSNorm fused
into its output. When sequences x heads are too few to fill the GPU, long sequences are cut into
segments whose affine maps are computed in parallel and combined by an exact scan.

What it supports (kdaserve/ops/kda/limits.py FLASH holds the checked values; the registry derives
the backend's requirements from it):
- platform: CUDA (developed for and tuned on H100/H200, sm_90); any CUDA GPU Triton supports
  should work (the PTX fast math of fastmath.py runs on sm_75+, plain Triton math below).
  ROCm: compiles for gfx942 and gfx950 (tools/compile_check.py), not yet run on one; fp32 dots
  take the target's precision (ops/precision.py), plain Triton math replaces the PTX, and gfx942
  runs K2 with two pipeline stages (config.config_for).
- inputs: bf16 or fp16 (fast path, fp16 workspace); fp32 works (IEEE dots, slow; for tests).
- head size: K = V = D in {16, 32, 64, 128}.
- gate: bounded ("safe", lower_bound in [-5, 0)) uses tensor cores for the in-chunk decay
  matrices at 32-token chunks; the unbounded gate the same in one pass, on a log-decay clamped
  per token inside the chunk's factors (16-bit inputs; 16-token chunks, 32 joined from two halves
  where the step is segmented), or exact nested anchors (fp32 inputs).
- recurrent state pool: fp32 or bf16, K contiguous; conv-state pool: SD or DS layout, any dtype.
- conv width W: any (4 in the supported models).
- varlen without a host sync; `cu_seqlens_cpu` only sharpens the grid sizes.
"""

from kdaserve.ops import interpreter_compat
from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG, FlashConfig
from kdaserve.ops.kda.flash.prefill import FlashStepPlan, flash_step_plan, kda_prefill_flash

interpreter_compat.install()

__all__ = ["DEFAULT_CONFIG", "FlashConfig", "FlashStepPlan", "flash_step_plan", "kda_prefill_flash"]
