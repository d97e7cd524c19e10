"""Compile the `fused` decode kernel (and, for comparison, `chain`'s recurrence kernel) for sm_90
without a GPU and report registers, spills, shared memory and whether the state moves in 16-byte
vectors (ld.global.v4 / st.global.v4 in the PTX).

    python -m tools.compile_check_fused      # one line per launch shape, then "ok"

Types are those of a bf16 serving step (bf16 q|k|v, logits, conv state and output; fp32 or bf16
state pool). Registers cap the programs per SM, and with them the state bytes in flight, which
is what the bandwidth-bound shapes' speed follows (docs/fused-decode.md). Must run without
TRITON_INTERPRET.
"""

from __future__ import annotations

import re

from kdaserve.ops.kda.fused.decode import STREAM_SHAPES, FusedDecodeConfig, default_config
from kdaserve.ops.kda.fused.decode_kernel import kda_fused_decode_kernel
from kdaserve.ops.kda.fused.stream_kernel import kda_fused_stream_kernel
from kdaserve.ops.kda.recurrent.kernel import kda_recurrent_kernel
from tools.sm90_compile import ARCH, compile_for_sm90, ptxas_report

REGS_PER_SM = 65536
SMEM_PER_SM = 227 * 1024


def vector_io(kernel) -> str:
    """Counts of 16-byte global loads/stores in the PTX (state tiles should use them)."""
    ptx = kernel.asm["ptx"]
    ld = len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))
    st = len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx))
    cp = len(re.findall(r"cp\.async", ptx))
    return f"ld.v4={ld} st.v4={st} cp.async={cp}"


def occupancy(report: str, warps: int) -> str:
    """Programs per SM as registers and shared memory allow (the H200: 64K registers, 227 KiB)."""
    regs = int(re.search(r"regs=(\d+)", report).group(1))
    smem = int(re.search(r"smem=(\d+)", report).group(1))
    return f"progs/SM<={min(REGS_PER_SM // (regs * 32 * warps), SMEM_PER_SM // max(smem, 1))}"


def tiles_in_flight(cfg: FusedDecodeConfig) -> int:
    """State tiles a program has requested but not yet consumed (at most)."""
    if cfg.stream:
        return max(cfg.stages - 1, 1 + cfg.prefetch) if cfg.stages else 1 + cfg.prefetch
    return 1


def fused_kernel(cfg: FusedDecodeConfig, state: str = "*fp32", H: int = 32, D: int = 128, tokens: int = 1):
    bf = "*bf16"
    types = dict(qkv=bf, forget_logits=bf, beta_logits=bf, output_gate_logits=bf, conv_w="*fp32", A_log="*fp32", dt_bias="*fp32",
                 norm_w="*fp32",
                 conv_state=bf, state=state, state_indices="*i32", spec_indices="*i32", num_accepted="*i32", out=bf,
                 ws_o="*i32", ws_count="*i32", lower_bound="fp32", norm_eps="fp32")
    bv = cfg.block_v or D
    if cfg.stream:
        types = {k: v for k, v in types.items() if k not in ("spec_indices", "num_accepted", "ws_o", "ws_count")}
        const = dict(H=H, D=D, L=3, SCALE=D**-0.5, BOUNDED_GATE=True, BV=bv, PREFETCH=cfg.prefetch,
                     STAGES=cfg.stages, WIN_REGS=bool(cfg.window_regs))
        return compile_for_sm90(kda_fused_stream_kernel, types, const, cfg.num_warps, 3)
    const = dict(H=H, D=D, L=3 + tokens - 1, TOKENS=tokens, SCALE=D**-0.5, IS_SPEC=tokens > 1, BOUNDED_GATE=True,
                 BV=bv, WIN_REGS=bv <= 16 if cfg.window_regs is None else cfg.window_regs,
                 STORE_FIRST=cfg.store_first)
    return compile_for_sm90(kda_fused_decode_kernel, types, const, cfg.num_warps, 3)


def chain_kernel(bv: int = 32, warps: int = 4, state: str = "*fp32", H: int = 32, D: int = 128):
    types = dict(y_ptr="*bf16", g_ptr="*bf16", b_ptr="*bf16", s_ptr=state, o_ptr="*bf16", a_log_ptr="*fp32",
                 dt_bias_ptr="*fp32", idx_ptr="*i32", spec_ptr="*i32", acc_ptr="*i32", lower_bound="fp32", scale="fp32")
    const = dict(M=1, K=D, V=D, BV=bv, IS_SPEC=False, BOUNDED=True)
    return compile_for_sm90(kda_recurrent_kernel, types, const, warps, 3)


def main(D: int = 128) -> None:
    print(f"sm_{ARCH}, H=32, D={D}; default (N*H=16384, fp32): {default_config(D, 1, 16384)}")
    for state in ("*fp32", "*bf16"):
        k = chain_kernel(state=state, D=D)
        rep = ptxas_report(k)
        occ = occupancy(rep, 4)
        flight = int(re.search(r"<=(\d+)", occ).group(1)) * 32 * D * (4 if state == "*fp32" else 2) / 1024
        print(f"chain recurrence bv32 w4 {state[1:]}: {rep} {occ} state in flight/SM<={flight:.0f} KiB {vector_io(k)}",
              flush=True)
    shapes = {"bv8 w1": FusedDecodeConfig(8, 1), "bv16 w4": FusedDecodeConfig(16, 4), "bv32 w4": FusedDecodeConfig(32, 4),
              "bv64 w4": FusedDecodeConfig(64, 4), **STREAM_SHAPES}
    for state in ("*fp32", "*bf16"):
        for name, cfg in shapes.items():
            k = fused_kernel(cfg, state, D=D)
            rep = ptxas_report(k)
            occ = occupancy(rep, cfg.num_warps)
            tile_kib = (cfg.block_v or D) * D * (4 if state == "*fp32" else 2) / 1024
            flight = int(re.search(r"<=(\d+)", occ).group(1)) * tiles_in_flight(cfg) * tile_kib
            print(f"fused {state[1:]} {name:20s}: {rep} {occ} state in flight/SM<={flight:.0f} KiB {vector_io(k)}",
                  flush=True)
    print("ok")


if __name__ == "__main__":
    main()
