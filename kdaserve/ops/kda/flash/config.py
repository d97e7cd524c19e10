"""Launch parameters of the flash prefill, in one place so a tuning run can change them.

Fixed configurations instead of autotuning: the recurrence updates the state pool in place, so
timing it repeatedly inside an autotuner would corrupt the cache. `python -m tools.tune_flash` times
alternatives on a GPU; each default's measurements are in docs/perf-notes.md ("What stays, by
evidence"), not here. Frozen: a variant is another FlashConfig (`dataclasses.replace(DEFAULT_CONFIG,
...)`) passed to `kda_prefill_flash` / `flash_step_plan`, never a global edited in place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

# The widest span of cumulative log-decay one anchor can factor: every factor within e^(+-85),
# normal fp32/tf32 numbers (e^88 overflows).
ONE_ANCHOR_SPREAD = 170.0


@dataclass(frozen=True, slots=True)
class FlashConfig:
    # Tokens per chunk, the serial step of the recurrence: 32 halves K2's steps for a few more K1
    # instructions per token than 16. The unbounded gate's: `unbounded_chunk`.
    chunk: int = 32
    prepare_warps: int = 4        # K1, one program per (chunk, head): fewer warp-instructions than 8
    # K1's chunk inverse, its W and U~ products and the joined halves' products on fp16 operands
    # when the workspace is fp16: tf32's 10-bit mantissa in half the registers and tensor-core
    # instructions (every such operand is bounded: entries of the inverse, e^g <= 1, values the
    # workspace holds in fp16 anyway).
    prepare_half_dots: bool = True
    # K1 asks for its chunk's q|k|v and forget-logit lines in L1 before it loads any (NVIDIA only:
    # PTX prefetch; the same outputs).
    prepare_prefetch: bool = True
    # The bounded gate's K1 register cap (0: the compiler's choice, 255 at C = 32: 2 programs per SM).
    # 168 lets 3 programs share an SM for a few spills.
    prepare_maxnreg: int = 168
    # Unbounded gate (Kimi-Linear's; docs/flash-prefill.md, "The unbounded gate"), K1's intra-chunk
    # factors in one pass for every chunk: "clamped" (16-bit workspaces; fp32 ones take "nested")
    # clamps each token's log-decay at -unbounded_decay_clamp inside the chunk's factors, so one
    # anchor spans 16 tokens (16 x clamp <= 170: factors within e^(+-85), normal fp32/tf32 numbers);
    # a factor that crosses a clamped token is below e^-clamp both truly and as computed, under the
    # 16-bit rounding. "nested" (prepare.py _intra_nested): exact for any decay, dearer.
    unbounded_intra: str = "clamped"
    unbounded_decay_clamp: float = 10.0
    # The unbounded gate's K1 register cap (0: the compiler's choice: 128 registers at C = 16, 4
    # programs per SM; 255 without spills for the joined halves at 32, which spill at a cap of 168).
    unbounded_prepare_maxnreg: int = 0
    # Tokens per chunk with the unbounded gate. The clamped K1 at 32 joins two anchored halves
    # (prepare.py _prepare_chunk_pair): a dearer K1 for half the recurrence's steps, which pays
    # where the recurrence's serial chain is the bound, i.e. in the steps flash segments (few long
    # sequences): unbounded_segmented_chunk there, unbounded_chunk elsewhere. fp32 inputs (the
    # nested K1) keep unbounded_chunk: nested at 32 spills on sm_90 and exceeds gfx942's VGPRs.
    unbounded_chunk: int = 16
    unbounded_segmented_chunk: int = 32
    recur_warps: int = 8          # K2, one program per (sequence, head), the whole [V, K] state
    # Software-pipelined loads of the next chunk's workspace (3 stages: bitwise the same outputs as
    # 2; 84 KB of shared memory).
    recur_stages: int = 3
    seg_block_v: int = 64         # rows of the state per program in the segment-map pass
    seg_warps: int = 4
    seg_stages: int = 2
    # Rows per program in the scan of segment maps (16 builds without spills; 32 is the faster with
    # checkpoints).
    scan_block_v: int = 32
    scan_warps: int = 8
    scan_stages: int = 1          # the [K, K] fp32 map is 64 KB of shared memory per stage
    # Checkpointing recurrence variants run their chunks in pieces between checkpoints (stores
    # outside the chunk loop: NVIDIA's build then needs no more shared memory than without them);
    # False: a store inside the loop, which needs less LDS on AMD (tools/compile_check).
    checkpoint_pieces: bool = True
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
        if self.unbounded_intra not in ("clamped", "nested"):
            raise ValueError(f"unbounded_intra must be 'clamped' or 'nested', got {self.unbounded_intra!r}")
        for name in ("unbounded_chunk", "unbounded_segmented_chunk"):
            if getattr(self, name) not in (16, 32):
                raise ValueError(f"{name} must be 16 or 32, got {getattr(self, name)}")
        if not 0 < self.unbounded_decay_clamp <= ONE_ANCHOR_SPREAD / 16:
            raise ValueError(f"unbounded_decay_clamp must be in (0, {ONE_ANCHOR_SPREAD / 16}] (one anchor spans 16 "
                             f"clamped tokens within e^(+-{ONE_ANCHOR_SPREAD / 2:g})), got {self.unbounded_decay_clamp}")


DEFAULT_CONFIG = FlashConfig()


def with_overrides(base: FlashConfig, text: str) -> FlashConfig:
    """`base` with `field=value,...` replaced, each value typed as the field is ("1"/"true"/"yes"
    for a bool); "default" is `base` itself. For benchmarks' --config flags: an unknown field is a
    ValueError that lists the fields."""
    if text == "default":
        return base
    kinds = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    changes = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in kinds:
            raise ValueError(f"no FlashConfig field {name!r} (in {text!r}); fields: {', '.join(kinds)}")
        kind = kinds[name]
        changes[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return replace(base, **changes)


def config_for(device: torch.device) -> FlashConfig:
    """The default launch parameters on `device`'s architecture (config_for_target)."""
    from kdaserve.ops.precision import device_target

    return config_for_target(device_target(device))


def config_for_target(target: str) -> FlashConfig:
    """The default launch parameters on `target` ("sm_90", "gfx942", ...; tools/compile_check.py
    compiles each target's): K2's third pipeline stage needs 84 KB of shared memory, more than
    gfx942's 64 KB of LDS per workgroup, so MI300 runs two; the segment-map pass spills at 4 warps on
    sm_100 and on AMD and runs 8 there; AMD's compiler has no register cap (Triton refuses the
    maxnreg option there, so K1 runs uncapped); AMD's checkpoint variants store inside the chunk loop
    (checkpoint_pieces). The H200 (sm_90) and everything else: the defaults."""
    if target == "gfx942":
        return replace(DEFAULT_CONFIG, recur_stages=2, seg_warps=8, prepare_maxnreg=0, checkpoint_pieces=False)
    if target == "gfx950":
        return replace(DEFAULT_CONFIG, seg_warps=8, prepare_maxnreg=0, checkpoint_pieces=False)
    if target.startswith("sm_") and int(target[3:]) >= 100:
        return replace(DEFAULT_CONFIG, seg_warps=8)
    return DEFAULT_CONFIG
