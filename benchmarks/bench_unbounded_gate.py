"""Kimi-Linear's unbounded gate against the bounded one: prefill of one KDA layer, ms, in one process.

Columns, on the same inputs (bench_prefill.gpu_case: bf16 q|k|v, fp32 state pool, D = 128, conv and
gated norm included but in fla-core):
  bounded     flash with the bounded gate (lower bound -5, same A_log, dt_bias and logits): the bar
  <variant>   flash with the unbounded gate: the default (clamped K1, 16-token chunks, 32 where the
              step is segmented, no register cap) and variants of it (FlashConfig)
  fla         FLA 0.6.0 through kdaserve's adapter (the serving path), unbounded gate
  fla-core    FLA's chunk_kda alone (bench_prefill.fla_core), unbounded gate

Gate regimes (no trained Kimi-Linear weights here), g = -exp(A_log) softplus(f + dt_bias), f ~ N(0, 1):
  default     the benchmark's: exp(A_log) uniform in [1, 16], dt_bias ~ N(0, 0.5)
  fla-init    FLA's initialisation: A uniform in [1, 16], dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]
  strong      every head exp(A_log) = 16, dt_bias = 1: ~22 of log-decay per token
For each regime, computed from the gate in torch, over 16-token (chunk, head) pairs: the fraction
one anchor could not take without the clamp (|g_C| > 170 in some channel: what the earlier
one-anchor pass sent to its exact fallback), and the fraction where the clamped K1 clamps some
token's log-decay (below -unbounded_decay_clamp). No chunk leaves the clamped K1's path.

Also: the first call's wall time per column (compilation; run in a fresh process with an empty
Triton cache to see it whole), K1's device time per variant (torch.profiler), and agreement with
the fp64 reference on a small mixed step (bench_prefill.agreement).

    PYTHONPATH=$PWD python benchmarks/bench_unbounded_gate.py [--heads 32 64] [--shapes 1x8K 16x1K]
        [--regimes default fla-init strong] [--no-fla]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time

import torch

from benchmarks.bench_prefill import bench_ms, fla_core, gpu_case, parse_shape, with_step_plan
from kdaserve.backends import planners
from kdaserve.ops.kda.flash import flash_step_plan, kda_prefill_flash
from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG
from kdaserve.ops.kda.flash.config import ONE_ANCHOR_SPREAD as SPREAD

REGIMES = ("default", "fla-init", "strong")


def set_regime(weights, regime: str, seed: int = 0) -> None:
    """Overwrite A_log and dt_bias in place (the case's logits stay)."""
    H, D = weights.dt_bias.shape
    g = torch.Generator().manual_seed(seed)
    if regime == "default":
        A = torch.rand(H, generator=g) * 15 + 1
        dt_bias = torch.randn(H, D, generator=g) * 0.5
    elif regime == "fla-init":
        A = torch.rand(H, generator=g) * 15 + 1
        dt = torch.exp(torch.rand(H, D, generator=g) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
        dt_bias = dt + torch.log(-torch.expm1(-dt))     # softplus^-1(dt)
    elif regime == "strong":
        A, dt_bias = torch.full((H,), 16.0), torch.ones(H, D)
    else:
        raise ValueError(f"unknown regime {regime!r}; expected one of {REGIMES}")
    weights.A_log.copy_(A.log())
    weights.dt_bias.copy_(dt_bias)


def leave_fractions(case, C: int = 16) -> tuple[float, float]:
    """(fraction of (chunk, head) pairs beyond one anchor without the clamp, fraction with a clamped
    token), over every chunk of every sequence, from the gate in fp32 as K1 computes it."""
    w = case.weights
    x = case.forget_logits.float().view(-1, case.H, case.D) + w.dt_bias.float()
    gk = -torch.exp(w.A_log.float())[:, None] * torch.nn.functional.softplus(x)
    beyond, clamped, total = 0, 0, 0
    starts = [0] + list(torch.tensor(case.seq_lens).cumsum(0).tolist())
    for a, b in zip(starts[:-1], starts[1:]):
        pad = -(b - a) % C
        seq = torch.nn.functional.pad(gk[a:b], (0, 0, 0, 0, 0, pad)).view(-1, C, case.H, case.D)
        beyond += int(((-seq.sum(1)).amax(-1) > SPREAD).sum())
        clamped += int((seq < -DEFAULT_CONFIG.unbounded_decay_clamp).flatten(-1).any(-1).any(1).sum())
        total += seq.shape[0] * case.H
    return beyond / total, clamped / total


def flash_column(config):
    def planner(cu, cu_cpu, T, H, settings):
        return flash_step_plan(cu, cu_cpu, T, H, settings.head_dim, settings.lower_bound is not None, config=config)

    return with_step_plan(kda_prefill_flash, planner)


def variants() -> dict:
    """The default and the variants of it this code has (older code: its one default)."""
    names = {f.name for f in dataclasses.fields(DEFAULT_CONFIG)}
    if "unbounded_intra" not in names:
        return {"flash": DEFAULT_CONFIG}
    r = functools.partial(dataclasses.replace, DEFAULT_CONFIG)
    return {"flash (default)": DEFAULT_CONFIG,
            "flash chunk 16": r(unbounded_chunk=16, unbounded_segmented_chunk=16),
            "flash chunk 32": r(unbounded_chunk=32, unbounded_segmented_chunk=32),
            "flash 168-register cap": r(unbounded_prepare_maxnreg=168),
            "flash nested": r(unbounded_intra="nested", unbounded_segmented_chunk=16),
            "flash nested, chunk 32": r(unbounded_intra="nested", unbounded_chunk=32, unbounded_segmented_chunk=32)}


def k1_device_us(fn, case, calls: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile

    out, args = case.new_out(), case.prefill_args()
    fn(out=out, **args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(out=out, **args)
        torch.cuda.synchronize()
    us = sum(getattr(e, "device_time_total", 0.0) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "prepare" in e.name)
    return us / calls


def first_call_s(fn, case) -> float:
    out, args = case.new_out(), case.prefill_args()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        fn(out=out, **args)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; bench_ms reports it again
        print(f"  first call failed: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[32])
    ap.add_argument("--shapes", nargs="+", default=["1x8K", "16x1K", "1x32K", "64x512"])
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="flash variants to run (names as in the table, without 'flash '); default: all")
    args = ap.parse_args()
    chosen = variants()
    if args.variants is not None:
        unknown = [v for v in args.variants if f"flash {v}" not in chosen]
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {[n.removeprefix('flash ') for n in chosen]}")
        chosen = {f"flash {v}": chosen[f"flash {v}"] for v in args.variants}
    flash_cols = {name: flash_column(cfg) for name, cfg in chosen.items()}
    bounded_col = with_step_plan(kda_prefill_flash, planners.flash_plan)
    fla_cols = {}
    if not args.no_fla:
        try:
            import fla.ops.kda  # noqa: F401

            from kdaserve.backends.adapters.fla import kda_prefill_fla

            fla_cols = {"fla": with_step_plan(kda_prefill_fla, planners.conv_tables), "fla-core": fla_core}
        except ImportError as e:
            print(f"fla columns skipped: {e}")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | flash variants: {list(flash_cols)}", flush=True)
    if not args.no_agreement:
        from benchmarks.bench_prefill import agreement

        agreement({**{n: c for n, c in flash_cols.items()}})

    rows, first_calls = [], {}
    for H in args.heads:
        for shape in args.shapes:
            lens = parse_shape(shape)
            for regime in args.regimes:
                case = gpu_case(lens, H, gate="unbounded")
                set_regime(case.weights, regime)
                bounded = dataclasses.replace(case, weights=dataclasses.replace(case.weights, lower_bound=-5.0))
                beyond, clamped = leave_fractions(case)
                row = {"H": H, "shape": shape, "regime": regime, "beyond one anchor": beyond, "clamped": clamped}
                cols = [("bounded", bounded_col, bounded)] + [(n, c, case) for n, c in {**flash_cols, **fla_cols}.items()]
                for name, fn, c in cols:
                    if name not in first_calls:
                        first_calls[name] = first_call_s(fn, c)
                    row[name] = bench_ms(fn, c)
                    if name.startswith("flash"):
                        row[f"K1 {name}"] = k1_device_us(fn, c) / 1e3
                row["K1 bounded"] = k1_device_us(bounded_col, bounded) / 1e3
                rows.append(row)
                print(row, flush=True)

    print("\nfirst call (s, compile included; a fresh process and an empty cache see all of it): "
          + ", ".join(f"{k} {v:.1f}" for k, v in first_calls.items()))
    names = list(flash_cols) + list(fla_cols)
    head = ["H", "shape", "regime", "beyond 1 anchor", "clamped", "bounded"] + names
    head += [f"{n} / bounded" for n in flash_cols] + [f"fla / {n}" for n in flash_cols if fla_cols]
    head += [f"fla-core / {n}" for n in flash_cols if fla_cols] + ["K1 bounded"] + [f"K1 {n}" for n in flash_cols]
    print("\nms per prefill (do_bench median); K1 = device ms of the prepare launches; 'beyond 1 anchor', 'clamped': fractions "
          "of 16-token (chunk, head) pairs\n"
          f"| {' | '.join(head)} |\n|{'---|' * len(head)}")
    for r in rows:
        cells = [str(r["H"]), r["shape"], r["regime"], f"{r['beyond one anchor']:.1%}", f"{r['clamped']:.1%}",
                 f"{r['bounded']:.3f}"] + [f"{r.get(n, float('nan')):.3f}" for n in names]
        cells += [f"{r[n] / r['bounded']:.2f}x" for n in flash_cols]
        if fla_cols:
            cells += [f"{r['fla'] / r[n]:.2f}x" for n in flash_cols] + [f"{r['fla-core'] / r[n]:.2f}x" for n in flash_cols]
        cells += [f"{r['K1 bounded']:.3f}"] + [f"{r[f'K1 {n}']:.3f}" for n in flash_cols]
        print(f"| {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
