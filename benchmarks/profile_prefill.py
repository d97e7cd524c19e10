"""Where the time of one prefill goes: every GPU kernel of each column, from torch.profiler.

Columns (same inputs, one run; see bench_prefill.py for the inputs):
  fla-arm   kdaserve.backends.adapters.fla.kda_prefill_fla (conv + chunk_kda + gather/scatter + norm)
  fla-core  FLA 0.6.0 `chunk_kda` alone on contiguous q/k/v, a dense initial state and the host
            cu_seqlens: the kernel-only number other projects report (no conv, no norm, no pool)
  flash     kdaserve.ops.kda.flash.kda_prefill_flash (automatic segmenting; flash-seg0 = never segment)

For each column: median ms (do_bench) and a table of kernels with their device µs per call,
summed over launches of the same kernel. The sum of kernel times below the wall time is launch
gaps or host work (syncs, Python) that the GPU waited for.

    PYTHONPATH=$PWD python benchmarks/profile_prefill.py --heads 32 --shapes 1x8K 16x1K \
        [--gate unbounded] [--columns flash] [--config prepare_half_dots=1]
"""

from __future__ import annotations

import argparse
import collections

import torch
import triton.testing

from benchmarks.bench_prefill import config_planner, gpu_case, parse_shape, with_step_plan
from kdaserve.backends import planners
from kdaserve.ops.kda.flash import flash_step_plan, kda_prefill_flash


def fla_core_fn(case):
    """chunk_kda alone with everything prepared outside the timing (the kernel-only FLA number)."""
    from fla.ops.kda import chunk_kda

    from kdaserve.backends.adapters.fla import _gate_args

    T, H, D = sum(case.seq_lens), case.H, case.D
    q, k, v = (t.contiguous() for t in case.qkv.view(1, T, 3, H, D).unbind(2))
    g = case.forget_logits.reshape(1, T, H, D).contiguous()
    beta = case.beta_logits.reshape(1, T, H).contiguous()
    h0 = case.recurrent_state[case.state_indices.long()].contiguous()
    cu, cu_cpu = case.cu_seqlens.long(), case.cu_seqlens_cpu.long()
    args = _gate_args(case.weights)

    def fn(out=None, **_):
        chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=D**-0.5, initial_state=h0, output_final_state=True,
                  cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **args)

    return fn


def columns(case, want: list[str], configs: tuple[str, ...] = ()) -> dict:
    cols = {}
    if "fla-arm" in want or "fla-core" in want:
        try:
            from kdaserve.backends.adapters.fla import kda_prefill_fla

            if "fla-arm" in want:
                cols["fla-arm"] = lambda out, **a: kda_prefill_fla(out=out, **a)
            if "fla-core" in want:
                cols["fla-core"] = fla_core_fn(case)
        except ImportError as e:
            print(f"fla columns skipped: {e}")
    if "flash" in want:
        cols["flash"] = with_step_plan(kda_prefill_flash, planners.flash_plan)
    if "flash-seg0" in want:
        never_segment = lambda cu, cu_cpu, T, H, s: flash_step_plan(cu, cu_cpu, T, H, s.head_dim,  # noqa: E731
                                                                    s.lower_bound is not None, segment_len=0)
        cols["flash-seg0"] = with_step_plan(kda_prefill_flash, never_segment)
    for text in configs:
        cols[f"flash[{text}]"] = with_step_plan(kda_prefill_flash, config_planner(text))
    return cols


def kernel_table(fn, calls: int = 5) -> tuple[dict, float]:
    """{kernel name: (launches per call, device µs per call)} and the summed device ms per call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name[:60]]
            a[0] += 1
            a[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    table = {k: (n / calls, us / calls) for k, (n, us) in agg.items()}
    return table, sum(us for _, us in table.values()) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[32])
    ap.add_argument("--shapes", nargs="+", default=["1x8K", "16x1K"])
    ap.add_argument("--columns", nargs="+", default=["fla-arm", "fla-core", "flash", "flash-seg0"])
    ap.add_argument("--config", action="append", default=[],
                    help="field=value[,...]: one more flash column with the FlashConfig changed so (repeatable)")
    ap.add_argument("--gate", choices=("bounded", "unbounded"), default="bounded")
    args = ap.parse_args()
    summary = []
    for H in args.heads:
        for shape in args.shapes:
            case = gpu_case(parse_shape(shape), H, gate=args.gate)
            a = case.prefill_args()
            out = case.new_out()
            for name, fn in columns(case, args.columns, tuple(args.config)).items():
                call = lambda: fn(out=out, **a)  # noqa: E731
                try:
                    call()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")
                    table, dev_ms = kernel_table(call)
                except Exception as e:  # noqa: BLE001 - one broken column must not lose the run
                    print(f"H={H} {shape} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                summary.append((H, shape, name, ms, dev_ms))
                print(f"\nH={H} {shape} {name}: {ms:.3f} ms wall (median), {dev_ms:.3f} ms in kernels", flush=True)
                for k, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
                    print(f"  {us:9.1f} us  x{n:<4.1f} {k}")
            case = a = out = None   # free the step before the next shape
            torch.cuda.empty_cache()
    print("\n| heads | shape | column | ms (do_bench median) | ms in kernels (profiler) |")
    print("|---|---|---|---|---|")
    for H, shape, name, ms, dev_ms in summary:
        print(f"| {H} | {shape} | {name} | {ms:.3f} | {dev_ms:.3f} |")


if __name__ == "__main__":
    main()
