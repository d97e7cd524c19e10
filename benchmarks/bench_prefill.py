"""Prefill of one KDA layer (varlen conv -> chunked core -> gated RMSNorm): ms, tokens/s, ratios.

Columns, side by side in one run on the same inputs (bf16 q|k|v, fp32 state pool, D = 128,
lower_bound -5 (--gate unbounded: Kimi-Linear's gate), every sequence resuming from its slot's state):
  flash  kdaserve.ops.kda.flash.kda_prefill_flash
  fla    FLA 0.6.0 `chunk_kda` as a serving engine must call it, through
         kdaserve.backends.adapters.fla.kda_prefill_fla: our Triton varlen conv, chunk_kda with the
         gate, l2norm and beta sigmoid in the kernel (what FLA supports), initial states gathered
         from the pool and final states scattered back, FLA's gated RMSNorm.
  fla-core  `chunk_kda` ALONE: contiguous q/k/v (post-conv), initial states already gathered,
         host cu_seqlens given; no conv, no norm, no pool. The kernel-only number other projects
         publish, and the strictest baseline: our columns do strictly more work than this one.
  flashkda-core  FlashKDA (`tokenspeed-flashkda`: CUTLASS, Hopper) `fwd` ALONE on the same prepared
         inputs as fla-core: the fastest KDA core we can measure at many (sequence, head) pairs
         (bounded gate only: its lower bound must be in [-5, 0]). Optional: skipped when not installed.
The conv and the gated RMSNorm are INCLUDED in every column but the -core ones.

Also printed: agreement of every column with the fp64 reference on a small mixed step (flash's
per-kernel breakdown: benchmarks/profile_prefill.py).

Run (H200; FLA's first-call autotuning per head count is most of it: ~2 min per head count with
every default shape, ~8 min for the whole default grid; split it across calls when time is short):
    PYTHONPATH=$PWD python benchmarks/bench_prefill.py --no-agreement [--device-time] \
        [--heads 16 32 64 96] [--shapes 1x8K 8x1K 16x1K 64x512 1x32K 1x64K 1x128K]
A launch-parameter variant beside the default, in the same process and with the same agreement
check: `--config prepare_half_dots=1 [--no-baselines]` (FlashConfig fields; column flash[...]).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import triton.testing

from kdaserve.backends import planners
from kdaserve.backends.requirements import LayerSettings
from kdaserve.testing.compare import rel_rms
from kdaserve.testing.inputs import KDACase, make_kda_case, make_kda_weights

D = 128
DEFAULT_SHAPES = ("1x8K", "8x1K", "16x1K", "64x512", "1x32K", "1x64K", "1x128K")


def parse_shape(text: str) -> list[int]:
    """'16x1K' -> sixteen sequences of 1024 tokens."""
    n, length = text.lower().split("x")
    mult = 1024 if length.endswith("k") else 1
    return [int(length.rstrip("k")) * mult] * int(n)


def gpu_case(seq_lens: list[int], H: int, seed: int = 0, gate: str = "bounded") -> KDACase:
    """A make_kda_case-like step generated on the GPU (CPU generation of a 64K x 64-head step takes
    longer than the whole benchmark). q|k|v and beta logits are column views of one projection."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    P, T, N = H * D, sum(seq_lens), len(seq_lens)
    weights = make_kda_weights(H, D, gate=gate, device=dev, generator=torch.Generator().manual_seed(seed))
    proj = torch.randn(T, 3 * P + H + 2 * D, device=dev, generator=g).to(torch.bfloat16)
    forget_logits = torch.randn(T, H, D, device=dev, generator=g).to(torch.bfloat16)
    output_gate_logits = torch.randn(T, H, D, device=dev, generator=g).to(torch.bfloat16)
    slots = N + 1
    conv_state = torch.randn(slots, 3, 3 * P, device=dev, generator=g).to(torch.bfloat16)
    state = torch.randn(slots, H, D, D, device=dev, generator=g) * 0.2
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
    return KDACase(
        H=H, D=D, seq_lens=list(seq_lens), proj=proj, qkv=proj[:, : 3 * P], beta_logits=proj[:, 3 * P : 3 * P + H],
        forget_logits=forget_logits, output_gate_logits=output_gate_logits, weights=weights, conv_state=conv_state,
        recurrent_state=state, conv_layout="SD",
        cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu, state_indices=torch.randperm(N, device=dev).add(1).to(torch.int32),
        has_initial_state=torch.ones(N, dtype=torch.bool, device=dev),
    )


def with_step_plan(fn, planner):
    """A column timed like one layer of an engine step: the step's plan (tables, the flash work
    plan) is built once per case by `planner`, outside the timing, as the engine builds it once
    per step for all layers (kdaserve.backends.planners)."""
    prepared = {}

    def column(out, inputs, weights, cache, seqs):
        # The gate kind too: a case of the other gate may reuse the freed memory of this one's inputs.
        key = (inputs.qkv.data_ptr(), tuple(seqs.cu_seqlens_cpu.tolist()), weights.num_heads,
               weights.lower_bound is None)
        if prepared.get("key") != key:
            settings = LayerSettings(input_dtype=inputs.qkv.dtype, head_dim=weights.head_dim,
                                     lower_bound=weights.lower_bound)
            prepared.update(key=key, plan=planner(seqs.cu_seqlens, seqs.cu_seqlens_cpu, inputs.qkv.shape[0],
                                                  weights.num_heads, settings))
        fn(inputs, weights, cache, seqs, out, step_plan=prepared["plan"])

    column.__name__ = getattr(fn, "__name__", "column")
    return column


def config_planner(text: str):
    """A flash step planner with the device's FlashConfig changed by `field=value,...` (--config)."""
    from kdaserve.ops.kda.flash import flash_step_plan
    from kdaserve.ops.kda.flash.config import config_for, with_overrides

    try:
        cfg = with_overrides(config_for(torch.device("cuda")), text)
    except ValueError as e:
        raise SystemExit(f"--config: {e}") from None

    def planner(cu, cu_cpu, T, H, settings):
        return flash_step_plan(cu, cu_cpu, T, H, settings.head_dim, settings.lower_bound is not None,
                               input_dtype=settings.input_dtype, config=cfg)

    return planner


def load_columns(configs: tuple[str, ...] = (), baselines: bool = True) -> dict:
    """flash, one flash[config] column per --config, and (baselines) every installed baseline."""
    from kdaserve.ops.kda.flash import kda_prefill_flash

    cols = {"flash": with_step_plan(kda_prefill_flash, planners.flash_plan)}
    for text in configs:
        cols[f"flash[{text}]"] = with_step_plan(kda_prefill_flash, config_planner(text))
    if not baselines:
        return cols
    try:
        import fla.ops.kda  # noqa: F401  (fail here, not inside the timing loop)

        from kdaserve.backends.adapters.fla import kda_prefill_fla

        cols["fla"] = with_step_plan(kda_prefill_fla, planners.conv_tables)
        cols["fla-core"] = fla_core
    except ImportError as e:
        print(f"fla column skipped: {e}")
    try:
        import flash_kda  # noqa: F401

        cols["flashkda-core"] = flashkda_core
    except ImportError as e:
        print(f"flashkda-core column skipped: {e}")
    return cols


CORE_COLUMNS = ("fla", "fla-core", "flashkda-core")   # the baselines: every other column is ours


def _core_inputs(inputs, weights, cache, seqs, prepared: dict) -> dict:
    """Contiguous post-conv q, k, v (here the projection's columns: the conv is not part of a
    core), gate and beta logits, the initial states gathered; made once per case."""
    qkv, forget_logits, beta_logits, _ = inputs
    recurrent_state = cache.recurrent_state
    cu_seqlens, state_indices, _, cu_seqlens_cpu = seqs
    key = (qkv.data_ptr(), recurrent_state.data_ptr(), tuple(qkv.shape))
    if prepared.get("key") != key:
        T, H = qkv.shape[0], weights.num_heads
        q, k, v = (t.contiguous() for t in qkv.view(1, T, 3, H, D).unbind(2))
        prepared.clear()
        prepared.update(key=key, q=q, k=k, v=v, g=forget_logits.reshape(1, T, H, D).contiguous(),
                        beta=beta_logits.reshape(1, T, H).contiguous(),
                        h0=recurrent_state[state_indices.long()].contiguous(),
                        cu=cu_seqlens.long(), cu_cpu=cu_seqlens_cpu.long())
    return prepared


def flashkda_core(out, inputs, weights, cache, seqs, _prepared={}):
    """FlashKDA's fwd alone, on fla-core's inputs (prepared once per case outside the timing); its
    output and final states into buffers of its own made with them."""
    import flash_kda

    if weights.lower_bound is None:
        raise ValueError("FlashKDA takes the bounded gate only (a lower bound in [-5, 0])")
    p = _core_inputs(inputs, weights, cache, seqs, _prepared)
    if "o" not in p:
        p.update(o=torch.empty_like(p["v"]), ht=torch.empty_like(p["h0"]), A_log=weights.A_log.float().contiguous(),
                 dt_bias=weights.dt_bias.reshape(weights.num_heads, D).float().contiguous())
    flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], D**-0.5, p["o"], p["A_log"], p["dt_bias"],
                  float(weights.lower_bound), initial_state=p["h0"], final_state=p["ht"], cu_seqlens=p["cu"])
    return p["o"]


def fla_core(out, inputs, weights, cache, seqs, _prepared={}):
    """FLA's chunk_kda alone, inputs prepared once per case outside the timing (see the docstring)."""
    from fla.ops.kda import chunk_kda

    from kdaserve.backends.adapters.fla import _gate_args

    p = _core_inputs(inputs, weights, cache, seqs, _prepared)
    o, _ = chunk_kda(q=p["q"], k=p["k"], v=p["v"], g=p["g"], beta=p["beta"], scale=D**-0.5, initial_state=p["h0"],
                     output_final_state=True, cu_seqlens=p["cu"], cu_seqlens_cpu=p["cu_cpu"], **_gate_args(weights))
    return o


def core_agreement(cols: dict, case: KDACase) -> None:
    """The core columns on one case against each other (same inputs, same math): relative RMS of
    their outputs, so a core that computes something else is seen, not timed."""
    cores = {name: fn for name, fn in cols.items() if name.endswith("-core")}
    if len(cores) < 2:
        return
    try:
        outs = {name: fn(out=case.new_out(), **case.prefill_args()).float() for name, fn in cores.items()}
    except Exception as e:  # noqa: BLE001 - bench_ms reports the failing column; the run goes on
        print(f"core agreement not checked: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    first, *others = outs
    print("core agreement (relative RMS of outputs): " + ", ".join(
        f"{name} vs {first} {rel_rms(outs[name], outs[first]):.2e}" for name in others), flush=True)


def host_us(fn, case: KDACase, calls: int = 30) -> float:
    """Host time per call (µs): back-to-back calls on a step so small that the GPU keeps up, so
    the wall time per call is the Python + launch cost a serving engine pays on every layer."""
    out = case.new_out()
    args = case.prefill_args()
    try:
        fn(out=out, **args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(out=out, **args)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return float("nan")


def bench_ms(fn, case: KDACase) -> float:
    """Median ms per call (NaN if the column fails: one broken column must not lose the run)."""
    out = case.new_out()
    args = case.prefill_args()
    try:
        fn(out=out, **args)  # compile / autotune outside the timing
        torch.cuda.synchronize()
        return triton.testing.do_bench(lambda: fn(out=out, **args), warmup=10, rep=40, return_mode="median")
    except Exception as e:  # noqa: BLE001 - reported, then the table goes on
        print(f"  FAILED {getattr(fn, '__name__', fn)} at H={case.H} lens={case.seq_lens[:3]}...: "
              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def agreement(cols: dict) -> None:
    """Every column against the fp64 reference (chunk-64 form) on one small mixed step, both gates."""
    from kdaserve.ops.kda.reference import kda_prefill_reference
    from kdaserve.testing.properties import run_prefill, to_fp64, valid_rows

    for gate in ("bounded", "unbounded"):
        base = make_kda_case([700, 1, 64, 300], H=32, D=D, dtype=torch.bfloat16, conv_dtype=torch.bfloat16, gate=gate,
                             slow_decay_heads=4, device="cuda", seed=1)
        ref = to_fp64(base)
        ref_out = run_prefill(functools.partial(kda_prefill_reference, chunk_size=64), ref, out_dtype=torch.float64)
        rows, used = valid_rows(base), base.state_indices.tolist()
        parts = []
        for name, fn in cols.items():
            c = base.clone()
            try:
                out = run_prefill(fn, c)
                parts.append(f"{name}: out {rel_rms(out[rows], ref_out[rows]):.1e}, "
                             f"state {rel_rms(c.recurrent_state[used], ref.recurrent_state[used]):.1e}")
            except Exception as e:  # noqa: BLE001
                parts.append(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        print(f"vs fp64 reference, {gate} gate, H=32, lens [700, 1, 64, 300] (rel RMS): " + "; ".join(parts), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[32, 16, 64, 96])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="NxL, e.g. 1x8K 16x1K 64x512")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--device-time", action="store_true",
                    help="also the kernels' device time per column (torch.profiler): ratios immune to host gaps")
    ap.add_argument("--gate", choices=("bounded", "unbounded"), default="bounded",
                    help="forget gate of the timed cases: GLM's bounded one (LB = -5) or Kimi-Linear's unbounded one")
    ap.add_argument("--config", action="append", default=[],
                    help="field=value[,...]: one more flash column with the FlashConfig changed so (repeatable)")
    ap.add_argument("--no-baselines", action="store_true", help="flash columns only (no FLA / FlashKDA)")
    args = ap.parse_args()
    t0 = time.time()
    cols = load_columns(tuple(args.config), baselines=not args.no_baselines)
    print(torch.cuda.get_device_name(), "| columns:", ", ".join(cols), f"| {args.gate} gate",
          "| conv + gated norm included in every column",
          flush=True)
    if not args.no_agreement:
        agreement({k: v for k, v in cols.items() if not k.endswith("-core")})
        print(f"  agreement done ({time.time() - t0:.0f} s)", flush=True)

    tiny = gpu_case([64] * 4, 32)
    print("host time per call, H=32, 4 x 64 tokens (µs; the GPU keeps up): "
          + ", ".join(f"{k} {host_us(fn, tiny):.0f}" for k, fn in cols.items()), flush=True)
    del tiny

    rows, dev_rows = [], []
    for H in args.heads:
        for shape in args.shapes:
            case = gpu_case(parse_shape(shape), H, gate=args.gate)
            if not rows:
                core_agreement(cols, case)
            T = sum(case.seq_lens)
            times = {name: bench_ms(fn, case) for name, fn in cols.items()}
            rows.append((H, shape, T, times))
            if args.device_time:
                dev_rows.append((H, shape, T, {name: device_ms(fn, case) for name, fn in cols.items()}))
            del case
            torch.cuda.empty_cache()
            print(f"  done H={H} {shape}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
                  + f" ({time.time() - t0:.0f} s)", flush=True)

    title = f"prefill, bf16 inputs, fp32 state, D={D}, {args.gate} gate: ms per call"
    print_table(rows, list(cols), f"{title}, wall time (do_bench median) [{time.time() - t0:.0f} s total]")
    if args.device_time:
        print_table(dev_rows, list(cols), f"{title}, device time (sum of the kernels' time, torch.profiler): "
                    "immune to host gaps")


def device_ms(fn, case: KDACase) -> float:
    """Kernel time per call (ms) summed over every launch, from the profiler: what the GPU spent,
    whatever the host did between launches (Python, syncs, a slow host CPU)."""
    from benchmarks.profile_prefill import kernel_table

    out = case.new_out()
    args = case.prefill_args()
    try:
        return kernel_table(lambda: fn(out=out, **args), calls=3)[1]
    except Exception:  # noqa: BLE001 - bench_ms already reported the failure
        torch.cuda.synchronize()
        return float("nan")


def print_table(rows: list, names: list[str], title: str) -> None:
    """One row per (heads, shape): ms (M tokens/s) per column, then every ours-vs-FLA ratio."""
    ours = [n for n in names if n not in CORE_COLUMNS]
    bases = [n for n in CORE_COLUMNS if n in names]
    ratio_names = [(o, b) for b in bases for o in ours]
    print(f"\n{title}; 'x vs b' = b ms / x ms (> 1: x is faster)")
    print("| heads | shape | tokens | " + " | ".join(names + [f"{o} vs {b}" for o, b in ratio_names]) + " |")
    print("|---|---|---|" + "---|" * (len(names) + len(ratio_names)))
    for H, shape, T, t in rows:
        cells = [f"{t[n]:.3f} ({T / t[n] / 1e3:.1f})" for n in names]
        ratios = [f"{t[b] / t[o]:.2f}x" for o, b in ratio_names]
        print(f"| {H} | {shape} | {T} | " + " | ".join(cells + ratios) + " |")

if __name__ == "__main__":
    main()
