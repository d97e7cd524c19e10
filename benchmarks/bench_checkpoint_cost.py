"""What prefix caching's in-launch state checkpoints cost flash: one KDA layer's prefill with and
without checkpoints every `--interval` tokens of each sequence (into spare slots of the pool), ms,
same inputs, one process, do_bench median; the step plan (the same with or without checkpoints)
built once per case outside the timing, as the engine builds it once per step. Issue goal: at most
3% of prefill time.

    PYTHONPATH=$PWD python benchmarks/bench_checkpoint_cost.py [--heads 32] [--shapes 1x8K 16x1K 1x32K 64x512]
        [--interval 512] [--cap 4] [--gate bounded unbounded] [--stages] [--config scan_stages=2 ...]

`--stages` adds a second table: each launch (FlashPrefill's methods, timed one by one) with and
without the checkpoints, to show which stage the cost lands in. `--config` (repeatable): time each
case under these FlashConfig variants too (comma-separated field=value), beside the default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_prefill import bench_ms, gpu_case, parse_shape  # noqa: E402
from kdaserve.ops.kda.flash import flash_step_plan, kda_prefill_flash  # noqa: E402
from kdaserve.ops.kda.flash.config import FlashConfig, config_for, with_overrides  # noqa: E402
from kdaserve.ops.kda.flash.prefill import FlashPrefill  # noqa: E402
from kdaserve.ops.kda.types import CheckpointRequests, PrefillSeqs  # noqa: E402


def with_checkpoints(case, interval: int, cap: int | None = None):
    """The case with spare slots for every interior multiple of `interval` in each sequence, or
    for its last `cap` of them (what the engine writes in one step: --prefix-cache-states-per-
    request, default 4, drops the oldest)."""
    per_seq, nxt = [], case.recurrent_state.shape[0]
    for n in case.seq_lens:
        offs = list(range(interval, n, interval))
        offs = offs[-cap:] if cap else offs
        per_seq.append([(o, nxt + j) for j, o in enumerate(offs)])
        nxt += len(offs)
    extra = nxt - case.recurrent_state.shape[0]
    case.recurrent_state = torch.cat([case.recurrent_state, case.recurrent_state[:1].expand(extra, -1, -1, -1).clone()])
    case.conv_state = torch.cat([case.conv_state, case.conv_state[:1].expand(extra, -1, -1).clone()])
    return CheckpointRequests.build(per_seq, case.qkv.device), sum(len(p) for p in per_seq)


def parse_config(text: str, device: torch.device) -> FlashConfig:
    """The device's FlashConfig with `field=value,...` replaced."""
    try:
        return with_overrides(config_for(device), text)
    except ValueError as e:
        raise SystemExit(f"--config: {e}") from None


def step_plan(case, cfg: FlashConfig):
    return flash_step_plan(case.cu_seqlens, case.cu_seqlens_cpu, case.T, case.H, case.D,
                           case.weights.lower_bound is not None, config=cfg)


def timed(case, ck, cfg: FlashConfig) -> float:
    with_ck = PrefillSeqs(case.cu_seqlens, case.state_indices, case.has_initial_state, case.cu_seqlens_cpu, ck)
    plan = step_plan(case, cfg)

    def fn(out, inputs, weights, cache, seqs):   # bench_ms passes the case's seqs: take ours, with the checkpoints
        kda_prefill_flash(inputs, weights, cache, with_ck, out, step_plan=plan)

    fn.__name__ = "flash+checkpoints" if ck is not None else "flash"
    return bench_ms(fn, case), plan.plan.segment_len if plan.plan.segmented else 0


def stage_ms(case, ck, cfg: FlashConfig) -> dict[str, float]:
    """Median ms of each launch of one step, timed alone (each reruns on the pool it left)."""
    seqs = PrefillSeqs(case.cu_seqlens, case.state_indices, case.has_initial_state, case.cu_seqlens_cpu, ck)
    plan = step_plan(case, cfg)
    step = FlashPrefill(case.inputs, case.weights, case.cache, seqs, case.new_out(), step_plan=plan)
    names = ["prepare"] + (["segment_maps", "scan", "segment_output"] if plan.plan.segmented else ["recurrence"])
    step.run()   # compile outside the timing
    torch.cuda.synchronize()
    return {name: triton.testing.do_bench(getattr(step, name), warmup=10, rep=40, return_mode="median")
            for name in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[32])
    ap.add_argument("--shapes", nargs="+", default=["1x8K", "16x1K", "1x32K", "64x512"])
    ap.add_argument("--interval", type=int, default=512)
    ap.add_argument("--cap", type=int, default=None, help="only each sequence's last N checkpoints (the engine's cap)")
    ap.add_argument("--gate", nargs="+", default=["bounded", "unbounded"])
    ap.add_argument("--stages", action="store_true", help="also time each launch with and without checkpoints")
    ap.add_argument("--config", action="append", default=[],
                    help="a FlashConfig variant to time beside the default, e.g. scan_stages=2,scan_block_v=16")
    args = ap.parse_args()
    device = torch.device("cuda")
    configs = [(text, parse_config(text, device)) for text in ["default", *args.config]]
    rows, stage_rows = [], []
    for gate in args.gate:
        for H in args.heads:
            for shape in args.shapes:
                case = gpu_case(parse_shape(shape), H, gate=gate)
                ck, count = with_checkpoints(case, args.interval, args.cap)
                for label, cfg in configs:
                    base, seg = timed(case, None, cfg)
                    with_ck, _ = timed(case, ck, cfg)
                    rows.append((label, gate, H, shape, count, base, with_ck, seg))
                    print(rows[-1], flush=True)
                    if args.stages:
                        plain, ckd = stage_ms(case, None, cfg), stage_ms(case, ck, cfg)
                        stage_rows += [(label, gate, H, shape, name, plain[name], ckd[name]) for name in plain]
                del case
    print(f"\n| config | gate | heads | shape | checkpoints (every {args.interval}) | flash ms | with checkpoints ms | "
          "cost | segment len |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, gate, H, shape, count, base, with_ck, seg in rows:
        print(f"| {label} | {gate} | {H} | {shape} | {count} | {base:.3f} | {with_ck:.3f} | "
              f"{(with_ck / base - 1) * 100:+.1f}% | {seg or '-'} |")
    if stage_rows:
        print("\n| config | gate | heads | shape | launch | ms | with checkpoints ms | difference ms |")
        print("|---|---|---|---|---|---|---|---|")
        for label, gate, H, shape, name, plain, ckd in stage_rows:
            print(f"| {label} | {gate} | {H} | {shape} | {name} | {plain:.4f} | {ckd:.4f} | {ckd - plain:+.4f} |")


if __name__ == "__main__":
    main()
