"""Kimi-Linear-48B-A3B (or another released model, `--model`) at its real shape on one GPU, with random
bf16 weights (`--load-format dummy`):
memory of weights and caches, the largest batch at 8K context, TTFT of one prompt per `--ttft`
length (default: --ctx) and its device time per layer kind (torch.profiler), decode tokens/s at
several batch sizes, and each decode step against its memory floor.

    PYTHONPATH=$PWD python3 benchmarks/bench_kimi_linear.py [--batches 1 64 256] [--ctx 8192] [--ttft 8192 32768]
    PYTHONPATH=$PWD python3 benchmarks/bench_kimi_linear.py --model inclusionAI/Ling-3.0-Flash --quantization fp8 \
        --num-hidden-layers 12      # a model too large for the GPU: its first layers at full width, FP8 weights

Method: the engine as `kdaserve serve` runs it (CUDA graphs for decode, the auto backends: flash +
adaptive for KDA, the Triton MLA and MoE kernels), Triton's start-up warm-up off (this script warms
each shape before timing it). TTFT = wall time from add_request to the first token of one prompt
alone (second of two runs, each its own random prompt, so no prefix is cached; the first
compiles); the breakdown per layer kind profiles a third. Decode: B sequences with
`--decode-ctx`-token prompts held in decode; the step is timed as a CUDA-graph replay (device time, do_bench median)
and as a whole engine step (host work and sampling included: the period of back-to-back step()
calls, so with async scheduling the host's work overlaps the device's); tokens/s = B / engine step.

Memory floor of a decode step = bytes that must move / the copy bandwidth measured in the same
process, per layer kind as kdaserve/evidence/layer_kinds.py counts them (dense weights but the
embedding table, the routed experts the step touches for uniform routing, the KDA states read and
written, the MLA latent rows of every context). Each decode batch's step is also profiled by layer
kind (10 engine steps under torch.profiler) and every kind set against its own floor.
Rows print as measured; the table prints last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_throughput import copy_bandwidth, random_prompts  # noqa: E402
from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.engine.caches import kv_bytes_per_block, state_bytes_per_slot  # noqa: E402
from kdaserve.evidence.layer_kinds import (  # noqa: E402
    ALL_KINDS,
    GEMM,
    KDA,
    MLA,
    MOE,
    OTHER,
    decode_floor_bytes,
    device_launches,
    device_ms_by_kernel,
    device_ms_by_kind,
)

MODEL = "moonshotai/Kimi-Linear-48B-A3B-Instruct"
GIB = 2**30


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def truncated_checkpoint(name: str, num_layers: int) -> str:
    """A directory holding only the config.json of released model `name` cut to its first
    `num_layers` layers (layer kinds and MLP kinds kept as released; no MTP layer), for
    --load-format dummy."""
    import json
    import tempfile

    from kdaserve.models.builtin import released_config

    config = released_config(name)
    if config is None:
        raise SystemExit(f"--num-hidden-layers needs a released model name, got {name!r}")
    d = config.to_dict()
    d["layer_types"] = config.layer_types[:num_layers]
    for key in ("mlp_layer_types", "indexer_types"):
        if isinstance(d.get(key), list):
            d[key] = d[key][:num_layers]
    for key in ("kda_layers", "full_attn_layers"):   # Kimi's and GLM's lists: layer_types says it now
        (d.get("linear_attn_config") or {}).pop(key, None)
    d["num_hidden_layers"] = num_layers
    path = Path(tempfile.mkdtemp(prefix="kdaserve-cut-"))
    (path / "config.json").write_text(json.dumps(d))
    return str(path)


def prefill_breakdown(eng, prompt) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Device ms of one prefill of `prompt` (warm), summed per layer kind from torch.profiler, and
    the kernels of the "other" kind, largest first."""
    from torch.profiler import ProfilerActivity, profile

    eng.add_request("breakdown", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
    out, other = device_ms_by_kind(prof.events())
    return out, other.most_common(12)


def decode_breakdown(eng, runner, graph_us: float, steps: int = 10) -> tuple[dict[str, float], str]:
    """Device us per decode step by layer kind: `steps` engine steps of the batch held in decode
    under torch.profiler (synchronized before and after, so exactly those steps' work), CUDA
    graphs on. Where the trace holds less than half the graph's time or fails (a profiler that
    does not see the kernels inside a replay) the steps run eagerly instead: the same kernels. Returns the
    breakdown and how it was taken; prints the step's largest kernels (us and launches per step)."""
    from torch.profiler import ProfilerActivity, profile

    largest: list[tuple[str, float, float]] = []   # (kernel, us, launches) per step of the trace kept

    def profiled() -> dict[str, float]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        events = prof.events()
        us = {k: v * 1e3 / steps for k, v in device_ms_by_kind(events)[0].items()}
        us["launches"] = device_launches(events) / steps   # a count per step, not us
        ms, launches = device_ms_by_kernel(events)
        largest[:] = [(name, v * 1e3 / steps, launches[name] / steps) for name, v in ms.most_common(16)]
        return us

    try:
        us, how = profiled(), "graph replays"
    except RuntimeError as e:   # a profiler that cannot trace a graph replay: the eager steps below
        print(f"  profiling graph replays failed ({e}); profiling eager steps", flush=True)
        us, how = {"total": 0.0}, ""
    if runner.graphs is not None and not us["total"] >= 0.5 * graph_us:
        graphs, runner.graphs = runner.graphs, None
        try:
            us, how = profiled(), "eager steps (the profiler saw no kernels inside the graph replays)"
        finally:
            runner.graphs = graphs
    print("  the step's largest kernels (device us and launches per step):\n"
          + "\n".join(f"    {us_:8.1f} us {n:4.0f}x  {name}" for name, us_, n in largest))
    return us, how


def step_period(eng, async_scheduling: bool) -> float:
    """The steady step period: step() calls back to back, as a server makes them (with async
    scheduling one step stays queued between calls), three rounds of 10, the median round."""
    eng.async_scheduling = async_scheduling
    for _ in range(2):
        eng.step()
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - s) / 10)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=8192, help="the long prompt (TTFT, largest batch)")
    ap.add_argument("--decode-ctx", type=int, default=512, help="prompt tokens of the decode batches")
    ap.add_argument("--ttft", type=int, nargs="+", default=None, help="prompt lengths to time (default: --ctx)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs to split the model over")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="with -tp N: whole experts per rank")
    ap.add_argument("--quantization", default=None,
                    help="fp8: block-scaled FP8 experts and linears; mxfp4 / compressed-tensors: 4-bit experts")
    ap.add_argument("--num-hidden-layers", type=int, default=None,
                    help="the released architecture cut to its first N layers (full width), for a model that does not fit")
    args = ap.parse_args()
    model = args.model
    if args.num_hidden_layers is not None:
        model = truncated_checkpoint(args.model, args.num_hidden_layers)
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} | copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    maxb = max(args.batches)
    lengths = args.ttft or [args.ctx]
    longest = max(lengths + [args.ctx])
    llm = LLM(model, load_format="dummy", max_num_seqs=maxb, max_model_len=longest + 64,
              max_num_batched_tokens=longest, gpu_memory_utilization=args.gpu_memory_utilization, warmup=False,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
              enable_expert_parallel=args.enable_expert_parallel)
    eng, runner = llm.engine, llm.engine.runner
    model = runner.model
    torch.cuda.synchronize()
    weights = param_bytes(model)
    plan = runner.memory.report or {}
    per_slot, per_tok = state_bytes_per_slot(model), kv_bytes_per_block(model, 1, runner.config.dtype)
    fit_8k = int(plan.get("free_gib", 0) * GIB // (per_slot + (args.ctx + 64) * per_tok))
    print(f"built in {time.time() - t0:.0f} s: weights {weights / GIB:.2f} GiB ({weights / 1e9:.2f} GB), "
          f"KDA state {plan.get('state_gib', 0):.2f} GiB ({runner.memory.num_slots} slots, {per_slot / 2**20:.1f} MiB each), "
          f"latent cache {plan.get('kv_gib', 0):.2f} GiB ({plan.get('kv_tokens', 0)} tokens, {per_tok} B per token), "
          f"memory left for caches {plan.get('free_gib', 0):.2f} GiB -> {fit_8k} sequences of {args.ctx} tokens fit; "
          f"backends {runner.kda_backends.names}", flush=True)

    rows, by_kind = [], []
    ttfts, kinds = {}, {}
    for n in lengths:
        # A fresh random prompt per run: with prefix caching on (the default) a repeated prompt
        # would be served from its cached prefix instead of prefilled.
        prompts = random_prompts(3, n, seed=5 + n)
        ttft = []
        for prompt in prompts[:2]:
            eng.add_request(f"ttft{n}-{len(ttft)}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            s = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            torch.cuda.synchronize()
            ttft.append(time.perf_counter() - s)
            print(f"  TTFT {n} tokens: {ttft[-1] * 1e3:.1f} ms ({time.time() - t0:.0f} s)", flush=True)
        ttfts[n] = ttft
        kinds[n], top_other = prefill_breakdown(eng, prompts[2])
        print(f"  prefill of {n} tokens by layer kind (device ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in kinds[n].items()), flush=True)
        print(f"  the largest of '{OTHER}':\n" + "\n".join(f"    {ms:8.2f} ms  {name}" for name, ms in top_other))

    from triton.testing import do_bench

    for B in args.batches:
        ids = [f"d{B}-{i}" for i in range(B)]
        for rid, p in zip(ids, random_prompts(B, args.decode_ctx, seed=B)):
            eng.add_request(rid, p, SamplingParams(max_tokens=10_000, ignore_eos=True))
        started: set[str] = set()
        while len(started) < B:
            started |= {o.request_id for o in eng.step() if o.new_token_ids}
        for _ in range(3):
            eng.step()
        step_s = step_period(eng, True)
        sync_s = step_period(eng, False)
        graph_us = float("nan")
        if runner.graphs is not None and B in runner.graphs.graphs:
            graph_us = do_bench(runner.graphs.graphs[B].replay, return_mode="median") * 1e3
        f = decode_floor_bytes(model, B, args.decode_ctx + 16, runner.config.dtype)
        floor_us = sum(f[k] for k in (MOE, MLA, KDA, GEMM)) / bw * 1e6
        kinds_us, how = decode_breakdown(eng, runner, graph_us)
        rows.append((B, step_s * 1e6, sync_s * 1e6, graph_us, B / step_s, floor_us, f))
        by_kind.append((B, kinds_us, {k: f[k] / bw * 1e6 for k in (MOE, MLA, KDA, GEMM)}, how))
        print(f"  B={B}: engine step {step_s * 1e6:.0f} us (one step at a time {sync_s * 1e6:.0f} us), graph "
              f"{graph_us:.0f} us, {B / step_s:.0f} tok/s, floor {floor_us:.0f} us; by kind ({how}): "
              + ", ".join(f"{k} {kinds_us[k]:.0f} us" for k in ALL_KINDS) + f" ({time.time() - t0:.0f} s)", flush=True)
        for rid in ids:
            eng.abort_request(rid)
        eng.step()

    print("\n| prefill of one prompt, by layer kind (device ms) | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for k in kinds[lengths[0]]:
        print(f"| {k} | " + " | ".join(f"{kinds[n][k]:.2f}" for n in lengths) + " |")
    cut = f" (its first {args.num_hidden_layers} layers)" if args.num_hidden_layers else ""
    print(f"\n{args.model} shape{cut}, random weights ({args.quantization or 'bf16'}), {torch.cuda.get_device_name()}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; TTFT " + "; ".join(
              f"{n} tokens {t[-1] * 1e3:.1f} ms (first run {t[0] * 1e3:.0f} ms, compiles included)" for n, t in ttfts.items())
          + f"; {fit_8k} sequences of {args.ctx} tokens fit")
    print("| batch | engine step us | one step at a time us | graph step us | tok/s | floor us | engine / floor | "
          "graph / floor | weights MB | experts/layer | state MB | latent MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, step_us, sync_us, graph_us, tps, floor_us, f in rows:
        print(f"| {B} | {step_us:.0f} | {sync_us:.0f} | {graph_us:.0f} | {tps:.0f} | {floor_us:.0f} | "
              f"{step_us / floor_us:.2f}x | {graph_us / floor_us:.2f}x | "
              f"{(f[GEMM] + f[MOE]) / 1e6:.0f} | {f['experts_touched']:.0f} | {f[KDA] / 1e6:.0f} | {f[MLA] / 1e6:.0f} |")
    print("\nDecode step by layer kind: device us per step (torch.profiler over 10 steps) against the kind's own floor "
          "(its bytes over the copy bandwidth; 'other' has none)")
    print("| batch | kind | device us | floor us | x floor | share of the step |")
    print("|---|---|---|---|---|---|")
    for B, us, floors, how in by_kind:
        for k in ALL_KINDS:
            fl = floors.get(k)
            cells = f"{fl:.0f} | {us[k] / fl:.2f}x" if fl else "- | -"
            print(f"| {B} | {k} | {us[k]:.0f} | {cells} | {us[k] / max(us['total'], 1e-9):.0%} |")
        print(f"| {B} | total ({how}; {us.get('launches', float('nan')):.0f} device launches per step) | "
              f"{us['total']:.0f} | {sum(floors.values()):.0f} | {us['total'] / sum(floors.values()):.2f}x | 100% |")


if __name__ == "__main__":
    main()
