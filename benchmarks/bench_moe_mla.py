"""The MoE and MLA kernels at Kimi-Linear's sizes against their own floors and side by side with
the plain torch path (issue "Fast at the real shape", goal 5), on one GPU:

- decode at batch 1..256: ms per call, eager (do_bench median: with the host's launch gaps) and
  replayed from a CUDA graph as the engine runs decode (do_bench_cudagraph median: device time),
  and the call's floor = bytes that must move / the measured copy bandwidth
  (MoE: the routed experts the batch touches, their gate|up and down weights; MLA: every context's
  latent rows, 8K tokens each by default);
- prefill at 1K..8K tokens: ms and the fraction of the card's dense bf16 tensor rate (989 TFLOP/s
  on an H200: MoE 2 x 3 x hidden x width flops per routed token; MLA causal attention flops).

    PYTHONPATH=$PWD python3 benchmarks/bench_moe_mla.py [--batches 1 8 64 256] [--prefill 1024 8192] [--ctx 8192]
        [--sweep]   # MLA decode: heads per program x context splits, graph-replayed, one table
        [--sweep-moe]   # MoE: launch shapes (rows per program, tiles, warps, stages)
        [--sweep-moe-fp4]   # MoE with MXFP4 experts: each GEMM's launch shapes apart
        [--sweep-mla-prefill]   # MLA prefill: tiles, warps, stages; Kimi-Linear's and GLM's heads
        [--sweep-shared]   # the MoE layer with its shared expert apart or inside the fused kernels
        [--sweep-align]   # the MoE slot alignment's paths at decode batches
        [--moe-prefill-paths]   # MoE prefill: fused kernels, a torch path on grouped_mm, dense cuBLAS
        [--moe-formats]   # fused MoE with bf16, FP8, MXFP4 and NVFP4 experts, each against its own floor
        [--moe-shape glm]   # the MoE tables at GLM-5.3-Flash's experts (or glm-tp2: one rank's half of each)

torch: ops/moe/reference.py's loop over experts and ops/mla/reference.py's gathers and einsums,
the definitions the kernels are tested against (no torch.compile), eager. "MoE align" rows: the
slot alignment alone, the path fused MoE takes (per expert up to 4096 slots, blocks of slots past)
against the torch path (torch column), both
graph-replayed. "MoE route" rows: routing (logits GEMM, then the one-launch kernel or the torch
path in the torch column), graph-replayed at decode, eager at prefill. Rows print as measured; the table prints last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_throughput import copy_bandwidth  # noqa: E402
from kdaserve.ops.mla.decode import mla_decode_triton  # noqa: E402
from kdaserve.ops.mla.prefill import mla_prefill_triton  # noqa: E402
from kdaserve.ops.mla.reference import mla_decode_reference, mla_prefill_reference  # noqa: E402
from kdaserve.ops.moe import RouterConfig, moe_experts_reference, route_tokens  # noqa: E402
from kdaserve.ops.moe.align import PER_EXPERT_MAX_SLOTS, align_to_experts  # noqa: E402
from kdaserve.ops.moe.fused import MoeTiles, moe_block_m, moe_experts_fused, moe_tiles  # noqa: E402
from kdaserve.ops.precision import device_target  # noqa: E402

# Kimi-Linear-48B-A3B: 256 experts (top 8) of width 1024 on hidden 2304; MLA with 32 heads, latent
# 512, rotary 64, nope and value heads 128. --moe-shape swaps in another model's experts
# (hidden, experts, top k, width): GLM-5.3-Flash's as transformers describes it, and one rank's
# share of them at -tp 2 (each expert's width halved).
MOE_SHAPES = {"kimi": (2304, 256, 8, 1024), "glm": (4096, 288, 8, 2048), "glm-tp2": (4096, 288, 8, 1024)}
HIDDEN, E, K, WIDTH = MOE_SHAPES["kimi"]
HEADS, LATENT, ROPE, NOPE, V = 32, 512, 64, 128, 128
PEAK_BF16 = 989e12
BF = torch.bfloat16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40)


def bench_graph(fn) -> float:
    fn()   # compile outside the capture
    torch.cuda.synchronize()   # the benchmark's side stream does not wait for the inputs' writes
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def routed_experts():
    """The routed experts of MOE_SHAPES' chosen model (Kimi-Linear's unless --moe-shape) and a router
    over them, at random (seed 0): (generator, w13, w2, gate, router)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * WIDTH, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5).to(BF)
    w2 = (torch.randn(E, HIDDEN, WIDTH, device="cuda", generator=g) * WIDTH**-0.5).to(BF)
    gate = torch.randn(E, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5
    return g, w13, w2, gate, RouterConfig(E, K, routed_scaling_factor=2.446)


def moe_rows(batches, prefill, bw, torch_max):
    g, w13, w2, gate, router = routed_experts()
    for step, T in [("decode", b) for b in batches] + [("prefill", t) for t in prefill]:
        x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(BF)
        weights, ids = route_tokens(x, gate, None, router)
        touched = ids.unique().numel()
        call = lambda: moe_experts_fused(x, w13, w2, weights, ids)   # noqa: E731
        ms = bench(call)
        mg = bench_graph(call) if step == "decode" else float("nan")
        mt = bench(lambda: moe_experts_reference(x, w13, w2, weights, ids)) if T <= torch_max else float("nan")
        nbytes = touched * 3 * HIDDEN * WIDTH * 2
        flops = 2 * 3 * HIDDEN * WIDTH * T * K
        floor = nbytes / bw * 1e3 if step == "decode" else flops / PEAK_BF16 * 1e3
        yield ("MoE", step, T, f"{touched} experts", ms, mg, mt, floor)
        # Routing alone (logits GEMM included, Kimi's correction bias): the one-launch kernel after the
        # logits vs the torch path; graphed at decode, eager at prefill.
        bias = torch.randn(E, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)) * 0.1
        timer = bench_graph if step == "decode" else bench
        route = [lambda kernel=kernel: route_tokens(x, gate, bias, router, use_kernel=kernel) for kernel in (True, False)]
        yield ("MoE route", step, T, f"kernel vs torch path ({'graph' if step == 'decode' else 'eager'})",
               bench(route[0]), timer(route[0]) if step == "decode" else float("nan"), timer(route[1]), float("nan"))
        # The alignment alone: the path fused MoE takes (per expert up to PER_EXPERT_MAX_SLOTS
        # slots, blocks of slots past) vs the torch path, both graphed.
        bm = moe_block_m(T * K, E)
        path = "per_expert" if T * K <= PER_EXPERT_MAX_SLOTS else "blocks"
        kernel = lambda: align_to_experts(ids, E, bm, path=path)   # noqa: E731
        yield ("MoE align", step, T, f"{path} kernel vs torch path (graph)", bench(kernel), bench_graph(kernel),
               bench_graph(lambda: align_to_experts(ids, E, bm, path="torch")), float("nan"))


def expert_formats(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, tuple[tuple, dict, float]]:
    """The same experts in each weight format the fused kernels take: name -> ((w13, w2), keyword
    arguments, bytes per parameter with the scales)."""
    from kdaserve.ops.fp4.reference import quantize_mxfp4, quantize_nvfp4
    from kdaserve.ops.fp4.weights import Fp4Weights
    from kdaserve.ops.fp8.reference import quantize_blocks

    def fp8(w):
        q = [quantize_blocks(e, (128, 128)) for e in w]
        return torch.stack([a for a, _ in q]), torch.stack([s for _, s in q])

    def fp4(w, nv):
        parts = [quantize_nvfp4(e) if nv else quantize_mxfp4(e) for e in w]
        div = torch.stack([p[2].expand(e.shape[0]) for p, e in zip(parts, w)]) if nv else None
        return Fp4Weights(torch.stack([p[0] for p in parts]), torch.stack([p[1].view(torch.uint8) for p in parts]), div,
                          16 if nv else 32).with_aligned_scales()   # as the layers store them

    (q13, s13), (q2, s2) = fp8(w13), fp8(w2)
    return {"bf16": ((w13, w2), {}, 2.0),
            "fp8": ((q13, q2), dict(w13_scale=s13, w2_scale=s2, block=(128, 128)), 1 + 4 / 128**2),
            "mxfp4": ((fp4(w13, False), fp4(w2, False)), {}, 0.5 + 1 / 32),
            "nvfp4": ((fp4(w13, True), fp4(w2, True)), {}, 0.5 + 1 / 16)}


def moe_formats(batches, prefill, bw, fp4_sides: bool = False) -> None:
    """The fused MoE call with the experts (--moe-shape) in bf16, block FP8, MXFP4 and NVFP4, one table:
    decode graph-replayed against each format's own floor (its bytes of the touched experts), and
    prefill eager with the fraction of the bf16 tensor rate. `fp4_sides`: each 4-bit format twice, its
    decoded tiles on the right of the dots and on the left (ops/fp4/tiles.fp4_weights_left; decode only),
    MXFP4 through tl.dot_scaled (native fp4 dots where the target has them, else Triton's decomposition)
    and MXFP4 on the left with scale codes past 128 (the words decoder's WIDE program)."""
    from kdaserve.ops.fp4.weights import Fp4Weights

    g, w13, w2, gate, router = routed_experts()
    formats = expert_formats(w13, w2)
    if fp4_sides:
        sided = {}
        for name, (w, kw, per) in formats.items():
            if not name.endswith("fp4"):
                sided[name] = (w, kw, per)
                continue
            for side in ("right", "left"):
                sided[f"{name} {side}"] = (w, {**kw, "fp4_left": side == "left"}, per)
            if name == "mxfp4":   # tl.dot_scaled, which Triton decomposes where the target has no fp4 dots
                sided[f"{name} dot_scaled"] = (w, {**kw, "fp4_dots": True}, per)
                # Scale codes past 128 (ops/fp4/word_decode.py: the WIDE words program); the values are
                # those weights times a power of two (the time, not the output, is what this row is for)
                wide = tuple(Fp4Weights(q.packed, q.scale + (130 - int(q.scale.min())), None, 32).with_aligned_scales()
                             for q in w)
                sided[f"{name} left wide"] = (wide, {**kw, "fp4_left": True}, per)
        formats = sided
    rows = []
    for step, T in [("decode", b) for b in batches] + [("prefill", t) for t in prefill]:
        x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(BF)
        weights, ids = route_tokens(x, gate, None, router)
        touched = ids.unique().numel()
        for name, ((a, b), kw, per_param) in formats.items():
            if step == "prefill" and name.endswith(" left"):   # served right (ops/fp4/tiles.fp4_weights_left)
                continue
            call = lambda a=a, b=b, kw=kw: moe_experts_fused(x, a, b, weights, ids, **kw)   # noqa: E731
            ms = bench_graph(call) if step == "decode" else bench(call)
            floor = (touched * 3 * HIDDEN * WIDTH * per_param / bw * 1e3 if step == "decode"
                     else 2 * 3 * HIDDEN * WIDTH * T * K / PEAK_BF16 * 1e3)
            rows.append((step, T, name, ms, floor))
            print(rows[-1], flush=True)
    print(f"\nexperts: {E} of width {WIDTH} on hidden {HIDDEN}, top {K}; {torch.cuda.get_device_name()}")
    print("| step | batch / tokens | experts in | ms (graph at decode) | floor ms | x floor | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    base = {(step, T): ms for step, T, name, ms, _ in rows if name == "bf16"}
    for step, T, name, ms, floor in rows:
        print(f"| {step} | {T} | {name} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f}x | {base[step, T] / ms:.2f}x |")


def _paged(B, ctx, bs=16):
    g = torch.Generator(device="cuda").manual_seed(1)
    blocks = -(-ctx // bs)
    cache = torch.randn(B * blocks + 1, bs, LATENT + ROPE, device="cuda", generator=g).to(BF)
    tables = (torch.arange(B * blocks, device="cuda", dtype=torch.int32) + 1).view(B, blocks)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    return cache, tables, lens


def mla_prefill_inputs(T: int, heads: int, nope: int, rope: int, vd: int, g) -> tuple[torch.Tensor, ...]:
    """Random bf16 (q_nope, q_pe, k_nope, k_pe, v) of one T-token sequence; k_pe shared by the heads."""
    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(BF)
    return r(T, heads, nope), r(T, heads, rope), r(T, heads, nope), r(T, rope), r(T, heads, vd)


def mla_rows(batches, prefill, ctx, bw, torch_max):
    scale = (NOPE + ROPE) ** -0.5
    g = torch.Generator(device="cuda").manual_seed(2)
    for B in batches:
        cache, tables, lens = _paged(B, ctx)
        q_lat = torch.randn(B, HEADS, LATENT, device="cuda", generator=g).to(BF)
        q_pe = torch.randn(B, HEADS, ROPE, device="cuda", generator=g).to(BF)
        call = lambda: mla_decode_triton(q_lat, q_pe, cache, tables, lens, scale)   # noqa: E731
        ms, mg = bench(call), bench_graph(call)
        mt = bench(lambda: mla_decode_reference(q_lat, q_pe, cache, tables, lens, scale)) if B <= torch_max else float("nan")
        floor = B * ctx * (LATENT + ROPE) * 2 / bw * 1e3
        yield ("MLA", "decode", B, f"ctx {ctx}", ms, mg, mt, floor)
        cache = None   # free this batch's cache before the next is allocated (del would leave the lambdas a deleted name)
    for T in prefill:
        q_n, q_p, k_n, k_p, v = mla_prefill_inputs(T, HEADS, NOPE, ROPE, V, g)
        ms = bench(lambda: mla_prefill_triton(q_n, q_p, k_n, k_p, v, [T], [T], scale))
        mt = bench(lambda: mla_prefill_reference(q_n, q_p, k_n, k_p, v, [T], [T], scale)) if T <= 4096 else float("nan")
        flops = 2 * HEADS * T * T / 2 * (NOPE + ROPE + V)   # causal: half the score matrix, QK^T and PV
        yield ("MLA", "prefill", T, "one sequence", ms, float("nan"), mt, flops / PEAK_BF16 * 1e3)


LAUNCHES = ((32, 8, 3), (64, 8, 2), (64, 8, 3), (32, 4, 3), (64, 4, 2))   # (tile, warps, stages)


def mla_decode_sweep(batches, ctx, bw) -> None:
    """Heads per program x context splits (1 = the one-launch kernel) x launch shapes (tile, warps,
    stages); graph-replayed device time.
    The table prints at the end; "chosen" marks what mla_decode_triton does by default."""
    from kdaserve.ops.mla.decode import choose_splits, dense_launch
    from kdaserve.ops.precision import device_target

    scale = (NOPE + ROPE) ** -0.5
    g = torch.Generator(device="cuda").manual_seed(3)
    *default_launch, auto_bh = dense_launch(device_target(torch.device("cuda")), LATENT)
    default_launch = tuple(default_launch)
    rows = []

    def run(B, bh, splits, launch, chosen, call_args, floor):
        try:
            ms = bench_graph(lambda: mla_decode_triton(*call_args, scale, num_splits=splits, block_h=bh, launch=launch))
        except Exception as e:   # noqa: BLE001 - a variant that does not compile is a row, not an abort
            print(f"B={B} block_h={bh} splits={splits} launch={launch}: {type(e).__name__}: {str(e)[:120]}")
            ms = float("nan")
        rows.append((B, bh, splits, launch, chosen, ms, floor))
        print(rows[-1], flush=True)
        return ms

    for B in batches:
        cache, tables, lens = _paged(B, ctx)
        q_lat = torch.randn(B, HEADS, LATENT, device="cuda", generator=g).to(BF)
        q_pe = torch.randn(B, HEADS, ROPE, device="cuda", generator=g).to(BF)
        args = (q_lat, q_pe, cache, tables, lens)
        floor = B * ctx * (LATENT + ROPE) * 2 / bw * 1e3
        max_splits = -(-tables.shape[1] * 16 // default_launch[0])
        for bh in (16, 32):
            auto = choose_splits(cache.device, B, -(-HEADS // bh), tables.shape[1] * 16, default_launch[0])
            for launch in LAUNCHES:
                for splits in sorted({1, 2, 4, 8, 16, 32, 64, auto} & set(range(1, max_splits + 1))):
                    run(B, bh, splits, launch, (bh, splits, launch) == (auto_bh, auto, default_launch), args, floor)
        del cache, args
    print("\n| batch | heads per program | splits | tile, warps, stages | chosen | graph ms | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|---|")
    for B, bh, splits, launch, chosen, ms, floor in rows:
        print(f"| {B} | {bh} | {splits} | {launch} | {'yes' if chosen else ''} | {ms:.4f} | {floor:.4f} | "
              f"{ms / floor:.2f}x |")


# Launch shapes the sweep crosses: (rows per program, gate_up and down (BN, BK, warps, stages)).
SWEEP_SHAPES = {   # None: moe_block_m's rows
    "decode": ([None], [(64, 64, 4, 3), (64, 128, 8, 3), (64, 128, 4, 3), (64, 128, 8, 4), (32, 128, 4, 3)],
               [(64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (64, 128, 8, 3)]),
    "prefill": ([None, 64, 128], [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 4), (64, 64, 8, 3)],
                [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (256, 64, 8, 4)]),
}


def kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """Device ms per call of the two expert GEMMs and of everything else (alignment, the sum)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {"gate_up": 0.0, "down": 0.0, "rest": 0.0}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            part = "gate_up" if "gate_up" in e.name else "down" if "_moe_down" in e.name else "rest"
            out[part] += getattr(e, "device_time_total", 0.0) / 1e3 / calls
    return out


def time_variant(call, want: torch.Tensor, timer, label: str) -> tuple[float, float, dict[str, float]]:
    """(ms, relative difference from `want`, device ms per kernel) of one launch shape; NaNs for a
    shape that does not compile (a row, not an abort)."""
    try:
        got = call().float()
        return timer(call), ((got - want).norm() / want.norm()).item(), kernel_ms(call)
    except Exception as e:   # noqa: BLE001
        print(f"{label}: {type(e).__name__}: {str(e)[:120]}")
        return float("nan"), float("nan"), {"gate_up": float("nan"), "down": float("nan"), "rest": float("nan")}


def moe_sweep(batches, prefill, bw) -> None:
    """The fused MoE path's launch shapes at Kimi-Linear's sizes: per step, the default and the
    cross product of SWEEP_SHAPES (decode: moe_block_m's rows, graph-replayed), with each kernel's
    device time (torch.profiler). Whole-call ms; the table prints last."""
    g, w13, w2, gate, router = routed_experts()
    rows = []
    for step, T in [("decode", b) for b in batches] + [("prefill", t) for t in prefill]:
        x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(BF)
        weights, ids = route_tokens(x, gate, None, router)
        touched = ids.unique().numel()
        floor = (touched * 3 * HIDDEN * WIDTH * 2 / bw if step == "decode" else 2 * 3 * HIDDEN * WIDTH * T * K / PEAK_BF16) * 1e3
        default = moe_tiles(T * K, E, HIDDEN, WIDTH, False, device_target(x.device))
        want = moe_experts_fused(x, w13, w2, weights, ids, tiles=default).float()
        timer = bench_graph if step == "decode" else bench
        bms, gate_ups, downs = SWEEP_SHAPES[step]
        variants = [("default", default)] + [
            (f"BM {bm}, gate_up {gu}, down {dn}", MoeTiles(bm, gu, dn))
            for bm in sorted({b or moe_block_m(T * K, E) for b in bms}) for gu in gate_ups for dn in downs]
        for name, tiles in variants:
            call = lambda: moe_experts_fused(x, w13, w2, weights, ids, tiles=tiles)   # noqa: B023, E731
            ms, err, parts = time_variant(call, want, timer, f"{step} {T} {name}")
            rows.append((step, T, name, ms, parts, floor, err))
            print(rows[-1], flush=True)
    print("\n| step | batch / tokens | variant | ms | gate_up ms | down ms | rest ms | floor ms | x floor | % of bf16 peak "
          "| rel. diff vs default |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for step, T, name, ms, parts, floor, err in rows:
        peak = f"{floor / ms * 100:.0f}%" if step == "prefill" else ""
        print(f"| {step} | {T} | {name} | {ms:.4f} | {parts['gate_up']:.4f} | {parts['down']:.4f} | {parts['rest']:.4f} "
              f"| {floor:.4f} | {ms / floor:.2f}x | {peak} | {err:.1e} |")


# 4-bit experts (MXFP4): each GEMM's launch shapes varied with the other at its default, since the
# two kernels are timed apart (kernel_ms). (BN, BK, warps, stages); None: the default's.
FP4_SWEEP = {
    "decode": [(32, 128, 4, 3), (64, 256, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
               (64, 128, 2, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 256, 4, 2), (128, 256, 4, 3), (128, 256, 8, 3),
               (64, 512, 4, 2)],
    "prefill": [(128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3)],
}


# Decode shapes of both GEMMs at once, each (columns, K step, warps, stages, register cap; None: the
# default's): for sm_90's decode with the decoded tiles left of the dots, where one more program an SM
# (a cap of 128 registers gives four of 4 warps) may pay more than the registers it takes.
FP4_PAIRS = [
    ((64, 128, 4, 3, None), (64, 256, 4, 3, None)),   # the right side's decode shapes (every other target's)
    ((64, 128, 4, 3, None), None),
    ((64, 128, 4, 3, 128), None),
    (None, (128, 128, 4, 3, 128)),
    ((64, 128, 4, 3, 128), (128, 128, 4, 3, 128)),
    ((64, 128, 4, 4, 128), (128, 128, 4, 4, 128)),
    (None, (128, 64, 4, 4, None)),
    (None, (256, 128, 8, 3, None)),
]


def _paired_tiles(default, gate_up, down):
    """MoeTiles from the default with either GEMM's (columns, K step, warps, stages, register cap) swapped in."""
    from kdaserve.ops.moe.fused import MoeTiles

    gu, dn = gate_up or (*default.gate_up, default.gate_up_regs), down or (*default.down, default.down_regs)
    return MoeTiles(default.block_m, gu[:4], dn[:4], gu[4], dn[4])


def fp4_moe_sweep(batches, prefill, bw, pairs: bool = False) -> None:
    """MXFP4 experts at Kimi-Linear's sizes (or --moe-shape's): per step the default launch shape, then each
    FP4_SWEEP shape for the gate|up GEMM (down at its default) and for the down GEMM (gate|up at
    its default), with each kernel's device time; the floor is the 4-bit bytes of the touched
    experts at decode. A shape that does not compile (or spills out of shared memory) is a row.
    `pairs`: at decode FP4_PAIRS instead (both GEMMs' shapes and register caps), prefill not run."""
    from kdaserve.ops.moe.fused import MoeTiles

    if pairs:
        prefill = []
    g, w13, w2, gate, router = routed_experts()
    (q13, q2), _, per_param = expert_formats(w13, w2)["mxfp4"]
    rows = []
    for step, T in [("decode", b) for b in batches] + [("prefill", t) for t in prefill]:
        x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(BF)
        weights, ids = route_tokens(x, gate, None, router)
        touched = ids.unique().numel()
        floor = (touched * 3 * HIDDEN * WIDTH * per_param / bw if step == "decode"
                 else 2 * 3 * HIDDEN * WIDTH * T * K / PEAK_BF16) * 1e3
        default = moe_tiles(T * K, E, HIDDEN, WIDTH, False, device_target(x.device), four_bit=True)
        want = moe_experts_fused(x, q13, q2, weights, ids, tiles=default).float()
        timer = bench_graph if step == "decode" else bench
        variants = [("default", default)]
        if pairs:
            variants += [(f"gate_up {gu or 'default'}, down {dn or 'default'}", _paired_tiles(default, gu, dn))
                         for gu, dn in FP4_PAIRS]
        for shape in [] if pairs else FP4_SWEEP[step]:
            variants.append((f"gate_up {shape}", MoeTiles(default.block_m, shape, default.down)))
            variants.append((f"down {shape}", MoeTiles(default.block_m, default.gate_up, shape)))
        for name, tiles in variants:
            call = lambda: moe_experts_fused(x, q13, q2, weights, ids, tiles=tiles)   # noqa: B023, E731
            ms, err, parts = time_variant(call, want, timer, f"{step} {T} {name}")
            rows.append((step, T, name, ms, parts, floor, err, str(default)))
            print(rows[-1][:7], flush=True)
    print("\n" + "\n".join(sorted({f"default at {step} {T}: {d}" for step, T, *_, d in rows})))
    print("\n| step | batch / tokens | variant | ms | gate_up ms | down ms | rest ms | floor ms | x floor "
          "| rel. diff vs default |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step, T, name, ms, parts, floor, err, _ in rows:
        print(f"| {step} | {T} | {name} | {ms:.4f} | {parts['gate_up']:.4f} | {parts['down']:.4f} | {parts['rest']:.4f} "
              f"| {floor:.4f} | {ms / floor:.2f}x | {err:.1e} |")


def align_sweep(batches) -> None:
    """The slot alignment's three paths at decode sizes (graph-replayed device ms), with and without
    the shared expert's column: where the per-expert path should hand over to the blocks path
    (ops/moe/align.PER_EXPERT_MAX_SLOTS)."""
    from kdaserve.ops.moe.router_kernel import route_from_logits

    g = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for T in batches:
        logits = torch.randn(T, E, device="cuda", generator=g)
        for extra in (False, True):
            _, ids = route_from_logits(logits, None, K, "sigmoid", True, 1.0, E if extra else None)
            bm = moe_block_m(ids.numel(), E + extra)
            times = [bench_graph(lambda p=p: align_to_experts(ids, E, bm, path=p, extra_expert=extra))   # noqa: B023
                     for p in ("per_expert", "blocks", "torch")]
            rows.append((T, ids.numel(), extra, bm, *times))
            print(rows[-1], flush=True)
    print("\n| batch | slots | shared expert column | rows per block | per_expert ms | blocks ms | torch ms |")
    print("|---|---|---|---|---|---|---|")
    for T, S, extra, bm, p, b, c in rows:
        print(f"| {T} | {S} | {'yes' if extra else 'no'} | {bm} | {p:.4f} | {b:.4f} | {c:.4f} |")


def torch_grouped_mm_experts(x, w13, w2, weights, ids, stages: dict | None = None) -> torch.Tensor:
    """The routed experts as a plain torch path on torch.nn.functional.grouped_mm (CUTLASS's grouped
    kernels on sm_90+): the slots sorted by expert and gathered, each expert's rows one group of
    the two GEMMs around SiLU(gate) * up, the weighted rows summed back per token in fp32.
    `stages`: filled with a callable per stage (order, gather, gate_up, swiglu, down, sum) over
    this call's intermediates, to time them apart."""
    import torch.nn.functional as F

    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    xs = x.index_select(0, order // k)
    # grouped_mm's right operand is [groups, K, N]: the weights' transposed views, read without a copy.
    gu = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up
    y = F.grouped_mm(h, w2.transpose(1, 2), offs=offs)
    w = weights.reshape(-1)[order].float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, order // k, y.float() * w[:, None])
    if stages is not None:
        stages.update(order=lambda: (torch.argsort(flat, stable=True), torch.bincount(flat, minlength=w13.shape[0]).cumsum(0)),
                      gather=lambda: x.index_select(0, order // k),
                      gate_up=lambda: F.grouped_mm(xs, w13.transpose(1, 2), offs=offs),
                      swiglu=lambda: F.silu(gate) * up,
                      down=lambda: F.grouped_mm(h, w2.transpose(1, 2), offs=offs),
                      sum=lambda: torch.zeros_like(out).index_add_(0, order // k, y.float() * w[:, None]))
    return out.to(x.dtype)


def moe_prefill_paths(prefill) -> None:
    """The routed experts at prefill sizes, same routing: the fused Triton kernels (moe_tiles'
    default), a plain torch path on torch's grouped GEMM (CUTLASS on sm_90+) stage by stage, and
    cuBLAS's dense GEMMs of the same shapes and flops as a bound (all tokens through one expert's
    weights: what the card does at these K and N without the grouping). "rows run": the rows the
    fused kernels multiply (each expert's run padded to its rows per program) over the routed rows;
    "% of peak on rows run" is the two GEMMs' rate over the rows they multiply, padding included.
    Eager do_bench medians; the table prints last."""
    g, w13, w2, gate, router = routed_experts()
    rows = []
    for T in prefill:
        x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(BF)
        weights, ids = route_tokens(x, gate, None, router)
        flops = 2 * 3 * HIDDEN * WIDTH * T * K
        want = moe_experts_reference(x, w13, w2, weights, ids).float() if T <= 8192 else None

        def diff(got):
            return float("nan") if want is None else ((got.float() - want).norm() / want.norm()).item()

        default = moe_tiles(T * K, E, HIDDEN, WIDTH, False, device_target(x.device))
        bm = default.block_m
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        run = ((counts + bm - 1) // bm * bm).sum().item()
        fused = lambda: moe_experts_fused(x, w13, w2, weights, ids, tiles=default)   # noqa: E731
        parts = kernel_ms(fused)
        rows.append((T, f"fused Triton (default tiles, {bm} rows per program)", bench(fused), parts["gate_up"],
                     parts["down"], parts["rest"], flops, run / (T * K), diff(fused())))
        stages = {}
        torch_grouped_mm_experts(x, w13, w2, weights, ids, stages)
        stage_ms = {name: bench(fn) for name, fn in stages.items()}
        grouped = lambda: torch_grouped_mm_experts(x, w13, w2, weights, ids)   # noqa: E731
        whole = bench(grouped)
        rows.append((T, "torch grouped_mm (" + ", ".join(f"{k} {v:.4f}" for k, v in stage_ms.items()) + ")", whole,
                     stage_ms["gate_up"], stage_ms["down"], whole - stage_ms["gate_up"] - stage_ms["down"], flops, 1.0,
                     diff(grouped())))
        S = T * K
        xd = torch.randn(S, HIDDEN, device="cuda", generator=g).to(BF)
        hd = torch.randn(S, WIDTH, device="cuda", generator=g).to(BF)
        m1, m2 = bench(lambda: xd @ w13[0].T), bench(lambda: hd @ w2[0].T)
        rows.append((T, f"cuBLAS dense GEMMs [{S}, {HIDDEN}] x [{HIDDEN}, {2 * WIDTH}] and [{S}, {WIDTH}] x [{WIDTH}, {HIDDEN}]",
                     m1 + m2, m1, m2, 0.0, flops, 1.0, float("nan")))
        for r in rows[-3:]:
            print(r, flush=True)
    print("\n| tokens | path | ms | gate_up ms | down ms | rest ms | % of bf16 peak (whole) | % of peak (two GEMMs) "
          "| rows run / routed | % of peak on rows run | rel. diff vs torch reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for T, name, ms, mg, md, rest, flops, padding, err in rows:
        gemms = flops / PEAK_BF16 / (mg + md) * 1e5
        print(f"| {T} | {name} | {ms:.4f} | {mg:.4f} | {md:.4f} | {rest:.4f} | {flops / PEAK_BF16 / ms * 1e5:.0f}% "
              f"| {gemms:.0f}% | {padding:.3f} | {gemms * padding:.0f}% | {err:.1e} |")


MLA_PREFILL_SHAPES = ((64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3),
                      (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                      (64, 64, 4, 2), (32, 32, 8, 2))   # (BLOCK_M, BLOCK_N, warps, stages)


def shared_expert_sweep(batches) -> None:
    """Kimi-Linear's MoE layer (layers/moe.MoEMLP: router, 256 routed experts, one shared expert of
    the same width) at each batch, graph-replayed, with the shared expert apart (cuBLAS GEMMs, the
    SwiGLU kernel, its output added in the MoE sum) and inside the fused kernels as expert 256:
    where "inside" stops winning is layers/moe.SHARED_AS_EXPERT_MAX_TOKENS."""
    import kdaserve.layers.moe as moe_layer

    router = RouterConfig(E, K, routed_scaling_factor=2.446)
    layer = moe_layer.MoEMLP(HIDDEN, router, WIDTH, num_shared_experts=1, backend="triton", dtype=BF, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, device="cuda", generator=g) * p.shape[-1] ** -0.5)
    default = moe_layer.SHARED_AS_EXPERT_MAX_TOKENS
    rows = []
    try:
        for T in batches:
            x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(BF)
            times, outs = {}, {}
            for how, limit in (("apart", -1), ("inside", 1 << 30)):
                moe_layer.SHARED_AS_EXPERT_MAX_TOKENS = limit
                outs[how] = layer(x).float()
                times[how] = bench_graph(lambda: layer(x))   # noqa: B023
            diff = ((outs["inside"] - outs["apart"]).norm() / outs["apart"].norm()).item()
            rows.append((T, times["apart"], times["inside"], diff, T <= default))
            print(rows[-1], flush=True)
    finally:
        moe_layer.SHARED_AS_EXPERT_MAX_TOKENS = default
    print(f"\n| batch | shared apart ms | shared inside ms | inside / apart | rel. diff | default (<= {default} tokens) |")
    print("|---|---|---|---|---|---|")
    for T, apart, inside, diff, chosen in rows:
        print(f"| {T} | {apart:.4f} | {inside:.4f} | {inside / apart:.2f}x | {diff:.1e} | {'inside' if chosen else 'apart'} |")


MLA_HEADS = {"kimi": (HEADS, NOPE, ROPE, V), "glm": (64, 256, 0, 256)}   # heads, nope, rope, value dims


def mla_prefill_sweep(prefill, models=tuple(MLA_HEADS)) -> None:
    """MLA prefill launch shapes, one sequence per step, Kimi-Linear's heads (32 x (128 + 64 rotary),
    values 128) and GLM-5.3-Flash's (64 x 256, no rotary part); do_bench median. The table prints last."""
    from kdaserve.ops.mla.prefill import launch_shape

    g = torch.Generator(device="cuda").manual_seed(4)
    rows = []
    for heads, nope, rope, vd in (MLA_HEADS[m] for m in models):
        scale = (nope + rope) ** -0.5
        default = launch_shape(device_target(torch.device("cuda")), nope, vd)
        for T in prefill:
            q_n, q_p, k_n, k_p, v = mla_prefill_inputs(T, heads, nope, rope, vd, g)
            want = mla_prefill_triton(q_n, q_p, k_n, k_p, v, [T], [T], scale).float()
            flops = 2 * heads * T * T / 2 * (nope + rope + vd)
            for shape in (default, *[s for s in MLA_PREFILL_SHAPES if s != default]):
                call = lambda: mla_prefill_triton(q_n, q_p, k_n, k_p, v, [T], [T], scale, launch=shape)   # noqa: B023, E731
                try:
                    err = ((call().float() - want).norm() / want.norm()).item()
                    ms = bench(call)
                except Exception as e:   # noqa: BLE001 - a shape that does not fit is a row, not an abort
                    print(f"{heads}x{nope}+{rope} T={T} {shape}: {type(e).__name__}: {str(e)[:120]}")
                    ms, err = float("nan"), float("nan")
                rows.append((f"{heads} x ({nope} + {rope})", T, shape, shape == default, ms, flops / PEAK_BF16 * 1e3, err))
                print(rows[-1], flush=True)
    print("\n| heads | tokens | BLOCK_M, BLOCK_N, warps, stages | default | ms | % of bf16 peak | rel. diff vs default |")
    print("|---|---|---|---|---|---|---|")
    for heads, T, shape, chosen, ms, floor, err in rows:
        print(f"| {heads} | {T} | {shape} | {'yes' if chosen else ''} | {ms:.4f} | {floor / ms * 100:.0f}% | {err:.1e} |")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prefill", type=int, nargs="*", default=[1024, 8192], help="prefill sizes (none: decode only)")
    ap.add_argument("--ctx", type=int, default=8192, help="context tokens per sequence in MLA decode")
    ap.add_argument("--torch-max", type=int, default=64, help="time the torch path up to this batch (it is slow)")
    ap.add_argument("--sweep", action="store_true", help="MLA decode launch variants instead of the main table")
    ap.add_argument("--sweep-moe", action="store_true", help="MoE launch shapes instead of the main table")
    ap.add_argument("--sweep-align", action="store_true", help="the MoE slot alignment's paths at --batches")
    ap.add_argument("--moe-prefill-paths", action="store_true",
                    help="prefill MoE: fused Triton kernels, torch's grouped GEMM path, dense cuBLAS GEMMs")
    ap.add_argument("--sweep-mla-prefill", action="store_true", help="MLA prefill launch shapes instead of the main table")
    ap.add_argument("--mla-heads", nargs="+", choices=list(MLA_HEADS), default=list(MLA_HEADS),
                    help="the models' MLA head shapes --sweep-mla-prefill times")
    ap.add_argument("--sweep-shared", action="store_true",
                    help="the MoE layer with the shared expert apart or inside the fused kernels, per batch")
    ap.add_argument("--sweep-moe-fp4", action="store_true",
                    help="MXFP4 experts' launch shapes, each GEMM's varied apart (issue 63)")
    ap.add_argument("--fp4-pairs", action="store_true",
                    help="with --sweep-moe-fp4: decode only, both GEMMs' shapes and register caps together (FP4_PAIRS)")
    ap.add_argument("--moe-formats", action="store_true",
                    help="fused MoE with the experts in bf16, FP8, MXFP4 and NVFP4, each against its own floor")
    ap.add_argument("--fp4-sides", action="store_true",
                    help="with --moe-formats: the 4-bit experts' decoded tiles on the right of the dots and on the left")
    ap.add_argument("--moe-shape", choices=list(MOE_SHAPES), default="kimi",
                    help="the experts' shape for the MoE tables (the MLA tables stay Kimi-Linear's)")
    args = ap.parse_args()
    global HIDDEN, E, K, WIDTH
    HIDDEN, E, K, WIDTH = MOE_SHAPES[args.moe_shape]
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 peak {PEAK_BF16 / 1e12:.0f} TFLOP/s")
    # One table instead of the main one, where a flag asks for it.
    alternatives = {"sweep": lambda: mla_decode_sweep(args.batches, args.ctx, bw),
                    "sweep_moe": lambda: moe_sweep(args.batches, args.prefill, bw),
                    "sweep_align": lambda: align_sweep(args.batches),
                    "moe_prefill_paths": lambda: moe_prefill_paths(args.prefill),
                    "sweep_mla_prefill": lambda: mla_prefill_sweep(args.prefill, args.mla_heads),
                    "sweep_shared": lambda: shared_expert_sweep(args.batches),
                    "moe_formats": lambda: moe_formats(args.batches, args.prefill, bw, args.fp4_sides),
                    "sweep_moe_fp4": lambda: fp4_moe_sweep(args.batches, args.prefill, bw, args.fp4_pairs)}
    for flag, run in alternatives.items():
        if getattr(args, flag):
            run()
            return
    rows = []
    for row in list(moe_rows(args.batches, args.prefill, bw, args.torch_max)) + list(
            mla_rows(args.batches, args.prefill, args.ctx, bw, args.torch_max)):
        rows.append(row)
        print(row, flush=True)
    print("\n| kernel | step | batch / tokens | what | triton ms | triton graph ms | torch ms | floor ms | triton x floor "
          "| torch / triton (graph where there is one) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kernel, step, n, what, ms, mg, mt, floor in rows:
        best = ms if mg != mg else mg   # the graph's device time where there is one (decode)
        print(f"| {kernel} | {step} | {n} | {what} | {ms:.4f} | {mg:.4f} | {mt:.4f} | {floor:.4f} | {best / floor:.2f}x "
              f"| {mt / best:.2f}x |")


if __name__ == "__main__":
    main()
