"""`fused` decode backend: the whole KDA decode step of a layer in one Triton launch.

Same calling convention as `kdaserve.ops.kda.reference.kda_decode_reference` (see its docstring):
plain decode (one token per sequence) and speculative verify (S+1 tokens per sequence with
`spec_state_indices` / `num_accepted_tokens`) both run in the one kernel. Only tensor metadata is
inspected on the host (no device->host sync), so a call is CUDA-graph capturable.

The conv weight is read in the derived `[3, W, P]` layout (`fused_conv_weight_layout`) from
`weights.conv_weight_decode`; when that is unset it is derived on every call: correct but slower
(one extra copy kernel per call), so layers should own and refresh the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kdaserve.ops.kda.checks import check_decode_step
from kdaserve.ops.kda.fused.conv_weight import fused_conv_weight_layout
from kdaserve.ops.kda.fused.decode_kernel import WS_SENTINEL, kda_fused_decode_kernel
from kdaserve.ops.kda.fused.stream_kernel import kda_fused_stream_kernel
from kdaserve.ops.kda.limits import FUSED
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights, conv_state_rows
from kdaserve.ops.triton_math import tl_dtype

IO_DTYPES = FUSED.input_dtypes


@dataclass(frozen=True, slots=True)
class FusedDecodeConfig:
    """Launch shape. Each program owns `block_v` V rows of one head's state (None = all D rows:
    one program per head, no workspace); D // block_v programs share a head through the split
    workspace (split_workspace). default_config says which shapes the measurements chose."""

    block_v: int | None = None
    num_warps: int = 4
    # Knobs of split shapes (benchmarks/bench_decode.py sweeps them):
    window_regs: bool | None = None  # conv rows rewritten from registers, not re-read (None: block_v <= 16)
    store_first: bool = False  # store the state tile before the arrival (the release waits for it)
    # The `stream` shape (plain decode only, stream_kernel.py): one program per head streams its
    # state in [block_v, K] tiles; no workspace, no meeting. Tiles ahead of the computed one:
    # `stages` >= 2: stages-1 through shared memory (Triton's pipeliner, cp.async), after 1 +
    # `prefetch` tiles loaded into registers first (in flight during the conv); stages == 0:
    # `prefetch` (0..2) tiles ahead in registers all the way.
    stream: bool = False
    stages: int = 0
    prefetch: int = 0


# Plain decode steps of at least this many heads (N*H) take the `stream` shape (stream_kernel.py):
# from there on it is the fastest shape measured, below it the split shapes are (numbers:
# docs/perf-notes.md, "Decode, stream shape"). 0 disables it.
STREAM_FROM_HEADS = 256
STREAM_FP32 = FusedDecodeConfig(block_v=16, num_warps=4, stream=True, stages=4)  # 96 regs, 5 programs/SM, 3 tiles in flight each
STREAM_BF16 = FusedDecodeConfig(block_v=16, num_warps=4, stream=True, stages=5)  # 87 regs, 5 programs/SM, 4 tiles in flight each
# On AMD (gfx942, gfx950) the bf16 [16, K] stream tile spills; [8, K] does not (tools/compile_check.py).
STREAM_BF16_AMD = FusedDecodeConfig(block_v=8, num_warps=4, stream=True, stages=5)
# The stream shapes benchmarks/bench_decode.py's sweep times and tools/compile_check_fused.py
# compiles: the defaults and the two that beat them in a row of the sweep (docs/perf-notes.md, "What
# stays, by evidence"). "stream bvX wY" + sZ = a Z-stage cp.async pipeline (Z-1 tiles in flight
# through shared memory), pfN = N tiles prefetched into registers.
STREAM_SHAPES = {
    "stream bv16 w4 pf1": FusedDecodeConfig(16, 4, stream=True, prefetch=1),
    "stream bv16 w4 s4": FusedDecodeConfig(16, 4, stream=True, stages=4),  # = STREAM_FP32
    "stream bv16 w4 s5": FusedDecodeConfig(16, 4, stream=True, stages=5),  # = STREAM_BF16
    "stream bv8 w4 s5": FusedDecodeConfig(8, 4, stream=True, stages=5),
}


def default_config(head_dim: int, tokens_per_seq: int, programs: int, state_bytes: int = 4,
                   verify: bool | None = None, amd: bool = False) -> FusedDecodeConfig:
    """Launch shape by the number of heads in the step (`programs` = N*H) and the state's element
    size; `verify` (default: more than one token per sequence) says the step is a speculative
    verify, which a verify with no drafts is too (one token, state in the spec slots). The rule, from
benchmarks/bench_decode.py's sweep (docs/perf-notes.md):
    - few heads are latency-bound: each head's rows go to D/8 one-warp programs (fp32: up to 512
      heads, bf16: up to 128, both below STREAM_FROM_HEADS), conv windows kept in registers;
    - many heads are bandwidth-bound: [64, K] tiles of 4 warps for an fp32 state, [32, K] for a
      2-byte one (the most state bytes in flight per SM in the sweep); from STREAM_FROM_HEADS
      heads on, one program per head streaming [16, K] tiles through a cp.async pipeline
      (STREAM_FP32 / STREAM_BF16; see STREAM_FROM_HEADS for the evidence);
    - speculative verify: one-warp [8, K] tiles up to 128 heads, else [32, K] (its tile stays in
      registers across the S+1 tokens, so [64, K] would not fit).
    Split heads meet by an arrival counter, never by one program waiting for another (that would
    need in-order dispatch of the grid, which no vendor guarantees)."""
    if verify if verify is not None else tokens_per_seq > 1:
        if programs <= 128:
            return FusedDecodeConfig(block_v=min(head_dim, 8), num_warps=1)
        return FusedDecodeConfig(block_v=min(head_dim, 32), num_warps=4)
    if STREAM_FROM_HEADS and programs >= STREAM_FROM_HEADS:
        cfg = STREAM_FP32 if state_bytes >= 4 else STREAM_BF16_AMD if amd else STREAM_BF16
        return replace(cfg, block_v=min(head_dim, cfg.block_v))
    if programs <= (512 if state_bytes >= 4 else 128):
        return FusedDecodeConfig(block_v=min(head_dim, 8), num_warps=1)
    if state_bytes >= 4:
        return FusedDecodeConfig(block_v=min(head_dim, 64), num_warps=4)
    return FusedDecodeConfig(block_v=min(head_dim, 32), num_warps=4)


# ---- split workspace -------------------------------------------------------------------------
# When D // block_v > 1 programs share a head, each writes its fp32 o-tile (as int32 bits) into the
# head's row of `o`; the program that finishes the head (the last to bump the head's counter)
# normalizes, then puts the row back to rest.
# Rules:
# - At rest (between launches) every counter is 0 and every `o` element holds WS_SENTINEL (each
#   launch leaves them so), so no memset launch is needed and the buffers stay valid inside CUDA
#   graphs.
# - Buffers are per device, grown (geometrically) only outside CUDA-graph capture, and never freed:
#   a captured graph keeps the addresses it recorded, and an outgrown buffer (all counters 0) stays
#   alive for it. Warm up once eagerly at the largest batch before capturing (the engine does).
# - Launches on one device must not run concurrently on two streams (they would share counters);
#   KDA layers of a step run one after the other on one stream.
_WORKSPACES: dict[torch.device, list[torch.Tensor]] = {}  # device -> [counters, o]; outgrown ones in _RETIRED
_RETIRED: list[torch.Tensor] = []


def split_workspace(device: torch.device, heads: int, o_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters int32 [>= heads], o fp32 [>= o_elems]) for one launch on `device`."""
    bufs = _WORKSPACES.get(device)
    if bufs is None or bufs[0].numel() < heads or bufs[1].numel() < o_elems:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fused decode: the split workspace must grow to {heads} heads x {o_elems // max(heads, 1)} "
                "values, which cannot happen during CUDA-graph capture: run the step once eagerly at this "
                "batch size (or larger) before capturing"
            )
        n_heads = max(4096, heads, bufs[0].numel() if bufs else 0)
        n_o = max(4096 * 128, o_elems, bufs[1].numel() if bufs else 0)
        new = [torch.zeros(1 << (n_heads - 1).bit_length(), dtype=torch.int32, device=device),
               torch.full((1 << (n_o - 1).bit_length(),), WS_SENTINEL.value, dtype=torch.int32, device=device)]
        if bufs is not None:
            _RETIRED.extend(bufs)
        _WORKSPACES[device] = bufs = new
    return bufs[0], bufs[1]


def _fail(msg: str) -> None:
    raise ValueError(f"fused decode: {msg}")


def _as_heads(t: torch.Tensor, T: int, H: int, D: int, name: str) -> torch.Tensor:
    """[T, H, D] view with contiguous D (a copy only for exotic strides)."""
    v = t.reshape(T, H, D)
    return v if v.stride(2) == 1 else v.contiguous()


def kda_decode_fused(inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs, out: torch.Tensor) -> None:
    """One launch per layer per step; see the module docstring and kda_decode_reference."""
    launch_fused_decode(None, inputs, weights, cache, seqs, out)


def launch_fused_decode(config: FusedDecodeConfig | None, inputs: KDAInputs, weights: KDAWeights, cache: KDACache,
                        seqs: DecodeSeqs, out: torch.Tensor) -> None:
    """kda_decode_fused with an explicit launch shape (None = default_config); benchmarks sweep it."""
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    state_indices, spec_state_indices, num_accepted_tokens = seqs
    T, H, D, N, tokens = check_decode_step(inputs, weights, cache, seqs, out)
    rows = conv_state_rows(conv_state, conv_layout)
    W = weights.conv_width
    FUSED.check(head_dim=D, lower_bound=weights.lower_bound, input_dtype=qkv.dtype, state_dtype=recurrent_state.dtype,
                conv_width=W)
    for name, t in (("out", out), ("conv_state", conv_state)):
        if t.dtype not in IO_DTYPES:
            _fail(f"{name} must be one of {IO_DTYPES}, got {t.dtype}")
    if recurrent_state.stride(3) != 1:
        _fail(f"recurrent_state must have K contiguous (stride 1 on the last dim), got strides {recurrent_state.stride()}")
    # A verify with no drafts (spec [N, 1]) is still a verify: its state lives in the spec slots,
    # which only the split shapes read, so it takes the verify rule, never the stream shape.
    is_spec = spec_state_indices is not None
    cfg = config or default_config(D, tokens, N * H, recurrent_state.element_size(), verify=is_spec,
                                   amd=recurrent_state.is_cuda and bool(torch.version.hip))
    block_v = cfg.block_v or D
    if block_v & (block_v - 1) or not 1 <= block_v <= D:
        _fail(f"block_v must be a power of two in [1, {D}], got {block_v}")
    try:
        out_v = out.view(T, H, D)
    except RuntimeError:
        out_v = None
    if out_v is None or out_v.stride(2) != 1:
        _fail(f"out must be viewable as [T, H, D] with D contiguous, got shape {tuple(out.shape)} strides {out.stride()}")
    if cfg.stream and is_spec:
        _fail(f"the stream launch shape runs plain decode only (no spec_state_indices), got a speculative verify of "
              f"{tokens} token(s) per sequence; use a split shape (stream=False)")
    if cfg.stream and not (0 <= cfg.prefetch <= 2 and (cfg.stages == 0 or 2 <= cfg.stages <= 8)):
        _fail(f"stream shape: prefetch must be 0, 1 or 2 tiles and stages 0 or 2..8, got {cfg.prefetch}, {cfg.stages}")
    if N == 0:
        return

    conv_w = weights.conv_weight_decode
    if conv_w is None:
        conv_w = fused_conv_weight_layout(weights.conv_weight)  # slower: a copy on every call
    elif tuple(conv_w.shape) != (3, W, H * D) or conv_w.dtype != torch.float32 or not conv_w.is_contiguous():
        _fail(
            f"weights.conv_weight_decode must be contiguous fp32 [3, W, P] = [3, {W}, {H * D}] "
            f"(built by fused_conv_weight_layout), got {conv_w.dtype} {tuple(conv_w.shape)}"
        )
    forget_v, out_gate_v = _as_heads(forget_logits, T, H, D,
                                     "forget_logits"), _as_heads(output_gate_logits, T, H, D, "output_gate_logits")
    spec = spec_state_indices if spec_state_indices is not None else state_indices.view(N, 1)
    accepted = num_accepted_tokens if num_accepted_tokens is not None else state_indices
    lb = weights.lower_bound

    if cfg.stream:
        kda_fused_stream_kernel[(N * H,)](
            qkv, forget_v, beta_logits, out_gate_v, conv_w,
            weights.A_log.contiguous(), weights.dt_bias.contiguous(), weights.norm_weight.contiguous(),
            conv_state, recurrent_state, state_indices, out_v,
            qkv.stride(0), forget_v.stride(0), forget_v.stride(1), beta_logits.stride(0), beta_logits.stride(1),
            out_gate_v.stride(0), out_gate_v.stride(1),
            rows.stride(0), rows.stride(1), rows.stride(2),
            recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
            out_v.stride(0), out_v.stride(1),
            0.0 if lb is None else float(lb), float(weights.norm_eps),
            H=H, D=D, L=rows.shape[1], SCALE=D**-0.5, BOUNDED_GATE=lb is not None,
            BV=block_v, PREFETCH=cfg.prefetch, STAGES=cfg.stages, WIN_REGS=bool(cfg.window_regs),
            GATE_DT=tl_dtype(weights.gate_dtype), num_warps=cfg.num_warps,
        )
        return

    split = D // block_v
    if split > 1:
        ws_count, ws_o = split_workspace(qkv.device, N * H, N * H * tokens * D)
    else:
        ws_count = ws_o = out_v  # unused (SPLIT == 1 compiles the workspace away)

    kda_fused_decode_kernel[(N * H * split,)](
        qkv, forget_v, beta_logits, out_gate_v, conv_w,
        weights.A_log.contiguous(), weights.dt_bias.contiguous(), weights.norm_weight.contiguous(),
        conv_state, recurrent_state, state_indices, spec, accepted, out_v, ws_o, ws_count,
        qkv.stride(0), forget_v.stride(0), forget_v.stride(1), beta_logits.stride(0), beta_logits.stride(1),
        out_gate_v.stride(0), out_gate_v.stride(1),
        rows.stride(0), rows.stride(1), rows.stride(2),
        recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        spec.stride(0), spec.stride(1), out_v.stride(0), out_v.stride(1),
        0.0 if lb is None else float(lb), float(weights.norm_eps),
        H=H, D=D, L=rows.shape[1], TOKENS=tokens, SCALE=D**-0.5,
        IS_SPEC=spec_state_indices is not None, BOUNDED_GATE=lb is not None,
        BV=block_v, WIN_REGS=block_v <= 16 if cfg.window_regs is None else cfg.window_regs,
        STORE_FIRST=cfg.store_first, GATE_DT=tl_dtype(weights.gate_dtype),
        num_warps=cfg.num_warps,
    )
