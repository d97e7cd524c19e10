"""Launch parameters of the flash prefill, in one place so a tuning run can change them.

Fixed configurations instead of autotuning: the recurrence updates the state pool in place, so
timing it repeatedly inside an autotuner would corrupt the cache (and first-call autotuning cost
70-90 s per shape elsewhere). `python -m tools.tune_flash` times alternatives on a GPU. Frozen: a
variant is another FlashConfig (`dataclasses.replace(DEFAULT_CONFIG, ...)`) passed to
`kda_prefill_flash` / `flash_step_plan`, never a global edited in place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, slots=True)
class FlashConfig:
    # Tokens per chunk, the serial step of the recurrence: 32 halves K2's steps for a few more K1
    # instructions per token than 16; the unbounded gate always uses 16.
    chunk: int = 32
    prepare_warps: int = 4        # K1, one program per (chunk, head): fewer warp-instructions than 8
    # Unbounded gate: K1's first pass forms A and Aqk on tensor cores around one anchor per chunk
    # ("one-anchor", the bounded gate's code) or per half ("halves", prepare.py
    # _intra_anchored_halves) wherever the factors' span of cumulative log-decay is at most
    # `unbounded_anchor_spread` (170: factors within e^(+-85), normal fp32/tf32 numbers), and flags
    # the other chunks; a second launch redoes only those (the halves where they fit after a
    # one-anchor pass, else the fallback). unbounded_anchored = False: the fallback everywhere, in
    # one launch. Fallback for any decay: "blocked" (prepare.py _intra_blocked: tensor-core dots
    # between 4-row blocks, exact exponents inside them) or "loop" (the exact column loop).
    unbounded_anchored: bool = True
    unbounded_first_pass: str = "one-anchor"
    unbounded_fallback: str = "blocked"
    # After a one-anchor pass, whether the redo tries the halves before the fallback (False: the
    # fallback for every flagged chunk, cheaper where most flagged chunks are beyond the halves too).
    unbounded_redo_halves: bool = True
    unbounded_anchor_spread: float = 170.0
    recur_warps: int = 8          # K2, one program per (sequence, head), the whole [V, K] state
    # Software-pipelined loads of the next chunk's workspace (3 stages: bitwise the same outputs as
    # 2, faster at many heads; 84 KB of shared memory; docs/perf-notes.md).
    recur_stages: int = 3
    seg_block_v: int = 64         # rows of the state per program in the segment-map pass
    seg_warps: int = 4
    seg_stages: int = 2
    scan_block_v: int = 32        # rows per program in the scan of segment maps
    scan_warps: int = 8
    scan_stages: int = 1          # the [K, K] fp32 map is 64 KB of shared memory per stage
    correct_chunks: int = 8       # chunks per program in the correction (output) pass
    correct_warps: int = 4
    # Segmenting long sequences pays when few (sequence, head) pairs leave SMs idle; plan.py's
    # choose_segment_len weighs it with these costs, in microseconds and nanoseconds as named;
    # `python -m tools.tune_flash --calibrate` measures them on the card at hand (how the H200's
    # compare with these: docs/flash-prefill.md).
    seg_min_len: int = 1024       # never segment when the longest sequence is shorter
    seg_min_tokens: int = 512     # never cut segments shorter than this
    recur_ctas_per_sm: int = 1    # K2 (255 registers x 8 warps): one program per SM
    seg_ctas_per_sm: int = 2      # map pass (254 registers x 4 warps)
    cost_step_full_us: float = 1.4   # one chunk step of K2 (at the default 32-token chunk)
    cost_step_seg_us: float = 0.85   # one chunk step of the map pass (half the rows)
    cost_scan_step_us: float = 2.0   # one segment of the scan
    cost_token_head_seg_ns: float = 0.35  # o_loc + q~ round trip and the correction pass

    def __post_init__(self):
        if self.unbounded_first_pass not in ("one-anchor", "halves"):
            raise ValueError(f"unbounded_first_pass must be 'one-anchor' or 'halves', got {self.unbounded_first_pass!r}")
        if self.unbounded_fallback not in ("blocked", "loop"):
            raise ValueError(f"unbounded_fallback must be 'blocked' or 'loop', got {self.unbounded_fallback!r}")


DEFAULT_CONFIG = FlashConfig()


def config_for(device: torch.device) -> FlashConfig:
    """The default launch parameters on `device`'s architecture (config_for_target)."""
    from kdaserve.ops.precision import device_target

    return config_for_target(device_target(device))


def config_for_target(target: str) -> FlashConfig:
    """The default launch parameters on `target` ("sm_90", "gfx942", ...; tools/compile_check.py
    compiles each target's): K2's third pipeline stage needs 84 KB of shared memory, more than
    gfx942's 64 KB of LDS per workgroup, so MI300 runs two; the segment-map pass spills at 4 warps on
    sm_100 and on AMD and runs 8 there. The H200 (sm_90) and everything else: the defaults."""
    if target == "gfx942":
        return replace(DEFAULT_CONFIG, recur_stages=2, seg_warps=8)
    if target == "gfx950" or (target.startswith("sm_") and int(target[3:]) >= 100):
        return replace(DEFAULT_CONFIG, seg_warps=8)
    return DEFAULT_CONFIG
