"""Time flash prefill variants side by side on a GPU (the launch parameters of config.py).

    python -m tools.tune_flash [--quick]
    python -m tools.tune_flash --calibrate   # the segment cost model's constants, this card

One table per shape (heads x sequences, bf16, fp32 state, D = 128, bounded gate): median ms of
each variant, tokens/s, and which one wins. Use it to set the defaults in config.py and the
segmenting thresholds. Runs in well under 2 minutes on an H200. `--calibrate` times the launches
the cost model of plan.choose_segment_len counts (~30 s) and prints its constants as measured.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kdaserve.ops.kda.flash import flash_step_plan, kda_prefill_flash
from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG as CONFIG
from kdaserve.ops.kda.flash.plan import build_plan, full_rounds, segmented_rounds
from kdaserve.ops.kda.flash.prefill import FlashPrefill
from kdaserve.ops.kda.types import KDACache, KDAInputs, PrefillSeqs
from kdaserve.testing.inputs import make_kda_weights

SHAPES = [  # (heads, sequence lengths): the goal shapes
    (16, [32768]), (16, [131072]), (16, [8192]), (16, [1024] * 16),
    (32, [8192]), (32, [1024] * 16), (32, [32768]),
    (64, [8192]), (64, [1024] * 8), (64, [1024] * 16),
    (96, [8192]), (96, [1024] * 8),
]


def gpu_inputs(H: int, lens: list[int], D: int = 128, seed: int = 0) -> dict:
    """A prefill step built on the GPU (CPU-side randn of 10^9 values would dominate the run)."""
    dev = "cuda"
    g = torch.Generator(dev).manual_seed(seed)
    T, N, P = sum(lens), len(lens), H * D
    bf = torch.bfloat16
    proj = torch.randn(T, 3 * P + H, device=dev, dtype=bf, generator=g)
    weights = make_kda_weights(H, D, device=dev, generator=torch.Generator().manual_seed(seed))
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    inputs = KDAInputs(proj[:, : 3 * P], torch.randn(T, H, D, device=dev, dtype=bf, generator=g), proj[:, 3 * P :],
                       torch.randn(T, H, D, device=dev, dtype=bf, generator=g))
    cache = KDACache(torch.randn(N + 1, 3, 3 * P, device=dev, dtype=bf, generator=g),
                     torch.randn(N + 1, H, D, D, device=dev, generator=g) * 0.2)
    seqs = PrefillSeqs(cu.to(dev), torch.arange(1, N + 1, dtype=torch.int32, device=dev),
                       torch.ones(N, dtype=torch.bool, device=dev), cu)
    return dict(inputs=inputs, weights=weights, cache=cache, seqs=seqs, out=torch.empty(T, H, D, device=dev, dtype=bf))


def variants(lens: list[int]) -> list[tuple[str, dict, int | None]]:
    longest = max(lens)
    v = [("auto", {}, None), ("no-seg", {}, 0),
         ("k1-8warps", {"prepare_warps": 8}, 0), ("k2-2stages", {"recur_stages": 2}, 0),
         # 8 warps under a 128-register cap: 2 programs per SM without spills (the bounded K1 on
         # sm_90), where 8 warps uncapped leave 1
         ("k1-8warps-128", {"prepare_warps": 8, "prepare_maxnreg": 128}, 0),
         ("chunk16", {"chunk": 16}, 0),
         # One segment per sequence through the segmented kernels: V split over 2 programs (no
         # fused norm: o_loc in fp32, then the correction pass only normalizes).
         ("split-v", {}, 1 << 24), ("split-v-c16", {"chunk": 16}, 1 << 24)]
    for seg in (1024, 2048, 4096, 8192):
        if seg < longest and longest // seg <= 64:
            v.append((f"seg{seg}", {}, seg))
    if longest >= 4096:
        v.append(("seg2048-bv128", {"seg_block_v": 128, "seg_warps": 8}, 2048))
    return v


def stages(inp: dict, segment_len: int | None) -> dict:
    """ms of each launch of one step, each timed alone (the step's plan and workspaces reused)."""
    import triton

    step = FlashPrefill(**inp, segment_len=segment_len)
    step.run()
    torch.cuda.synchronize()
    plan = lambda: build_plan(step.cu, step.T, step.N, step.C, step.plan.segment_len if step.plan.segmented else None,  # noqa: E731
                              inp["seqs"].cu_seqlens_cpu)
    fns = {"plan": plan, "prepare": step.prepare}
    if step.plan.segmented:
        fns.update(maps=step.segment_maps, scan=step.scan, correct=step.segment_output)
    else:
        fns["recurrence"] = step.recurrence
    return {k: triton.testing.do_bench(f, warmup=5, rep=30, return_mode="median") for k, f in fns.items()}


def derive_cost_constants(recurrence_ms: float, full_steps: int, maps_ms: float, scan_ms: float, correct_ms: float,
                          seg_steps: int, seg_pieces: int, seg_token_heads: int) -> dict[str, float]:
    """config.py's cost_* fields from launch times: the unsegmented recurrence per chunk step, the
    map pass per chunk step (steps and pieces as plan.segmented_rounds counts them), the scan per
    segment, the correction pass per token-head."""
    return {
        "cost_step_full_us": recurrence_ms * 1e3 / full_steps,
        "cost_step_seg_us": maps_ms * 1e3 / seg_steps,
        "cost_scan_step_us": scan_ms * 1e3 / seg_pieces,
        "cost_token_head_seg_ns": correct_ms * 1e6 / seg_token_heads,
    }


def calibrate(D: int = 128) -> dict[str, float]:
    """Measure the cost model's constants on this GPU: 64 heads x 8K unsegmented (one chain per
    SM at most, as the model's unsegmented step assumes), 16 heads x 32K in 8K segments."""
    cfg, sms = CONFIG, torch.cuda.get_device_properties(0).multi_processor_count
    H_full, lens_full = min(64, sms * cfg.recur_ctas_per_sm), [8192]
    st_full = stages(gpu_inputs(H_full, lens_full, D), 0)
    H_seg, lens_seg, seg = 16, [32768], 8192
    st_seg = stages(gpu_inputs(H_seg, lens_seg, D), seg)
    seg_steps, pieces = segmented_rounds(lens_seg, H_seg, D, cfg.chunk, seg, sms, cfg)
    return derive_cost_constants(st_full["recurrence"], full_rounds(lens_full, H_full, cfg.chunk, sms, cfg),
                                 st_seg["maps"], st_seg["scan"], st_seg["correct"], seg_steps, pieces,
                                 sum(lens_seg) * H_seg)


def main() -> None:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="auto and no-seg only")
    ap.add_argument("--calibrate", action="store_true", help="measure the segment cost model's constants only")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.calibrate:
        measured = calibrate()
        print(f"cost model constants on {torch.cuda.get_device_name(0)} (config.py: measured / current):")
        for k, v in measured.items():
            print(f"  {k} = {v:.3f}  # now {getattr(CONFIG, k)}")
        return
    rows = []
    for H, lens in SHAPES:
        inp = gpu_inputs(H, lens)
        T = sum(lens)
        best = None
        for name, cfg, seg in variants(lens)[: 2 if args.quick else None]:
            # One plan per step, as the engine builds it: the timed calls are the layers' work.
            plan = flash_step_plan(inp["seqs"].cu_seqlens, inp["seqs"].cu_seqlens_cpu, T, H, inp["weights"].head_dim,
                                   inp["weights"].lower_bound is not None, config=dataclasses.replace(CONFIG, **cfg),
                                   segment_len=seg)
            fn = lambda inp=inp, plan=plan: kda_prefill_flash(**inp, step_plan=plan)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
            rows.append((H, f"{len(lens)}x{lens[0] // 1024}K", name, ms, T / ms / 1e3))
            best = min(best or (ms, name), (ms, name))
        print(f"H={H} {len(lens)}x{lens[0]}: best {best[1]} {best[0]:.3f} ms", flush=True)
        del inp
        torch.cuda.empty_cache()
    print("\nstages (ms, each launch alone, default config):")
    for H, lens in [(64, [8192]), (64, [1024] * 8), (16, [32768])]:
        inp = gpu_inputs(H, lens)
        for seg in (0, None):
            st = stages(inp, seg)
            print(f"  H={H} {len(lens)}x{lens[0]} segment_len={seg}: " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()),
                  flush=True)
        del inp
        torch.cuda.empty_cache()
    print(f"\n{'heads':>5} {'shape':>8} {'variant':>14} {'ms':>8} {'M tok/s':>8}")
    for H, shape, name, ms, mtps in rows:
        print(f"{H:>5} {shape:>8} {name:>14} {ms:>8.3f} {mtps:>8.1f}")


if __name__ == "__main__":
    main()
