"""Offline serving throughput of the `bench` model per KDA backend pair, and the decode step time
at a fixed batch against its memory floor.

    python benchmarks/bench_throughput.py                       # flash+fused, flash+chain, fla+fla
    python benchmarks/bench_throughput.py --pairs flash+chain,auto+auto --num-requests 64

For each pair (prefill+decode backend): build the engine (CUDA graphs captured), warm up, run
`--num-requests` requests of `--input-len` random prompt tokens and exactly `--output-len` output
tokens, then hold `--decode-batch` sequences in decode and time one decode step as a CUDA-graph
replay (device time, median) and as a whole engine step (host work and sampling included).

Triton compiles are counted per phase (engine build with its startup warm-up, this script's
warm-up, each timed run): a compile inside a timed run is a kernel variant the engine's warm-up
missed. To check the engine's warm-up alone, run with a fresh TRITON_CACHE_DIR and
--no-script-warmup: the first timed run should then be as fast as the last.

Memory floor of a decode step = (weight bytes + state bytes read and written) / copy bandwidth,
the bandwidth measured here by a device-to-device copy; "+KV" adds the K/V rows the full-attention
layers must read. A pair whose backends cannot run here is listed with the reason and skipped.
Prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdaserve.backends import BackendError  # noqa: E402
from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args  # noqa: E402
from kdaserve.engine.caches import kv_bytes_per_block, state_bytes_per_slot  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    from triton.testing import do_bench

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    src = dst = None   # free the 2 GiB before returning (rebound: the timed lambda names them)
    return 2 * n / (ms * 1e-3)


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the model: every parameter and buffer, except the embedding
    and rotary tables, of which only a few rows are read."""
    total = 0
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen or "embed_tokens" in name or "cos_sin_cache" in name:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


class TritonCompiles:
    """Counts the kernel specializations Triton compiles (or loads from its disk cache) in this
    process while the block runs: inside a timed run, each is a stall the engine's warm-up missed."""

    def __enter__(self):
        from triton import knobs

        self.names, self._knobs = [], knobs.runtime
        self._before = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = lambda **kw: self.names.append(kw["repr"].split("[")[0]) and None
        return self

    def __exit__(self, *exc):
        self._knobs.jit_post_compile_hook = self._before


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


def run_pair(pair: str, args) -> dict:
    prefill, decode = pair.split("+")
    row = {"pair": pair}
    t0 = time.perf_counter()
    try:
        with TritonCompiles() as jit:
            llm = LLM(**engine_kwargs_from_args(args, kda_prefill_backend=prefill, kda_decode_backend=decode,
                                                max_model_len=args.input_len + args.output_len + 64))
    except (BackendError, ValueError) as exc:
        row["skipped"] = str(exc).splitlines()[0] + " " + " ".join(l.strip() for l in str(exc).splitlines()[1:])
        return row
    torch.cuda.synchronize()
    row["build_s"] = time.perf_counter() - t0
    row["jit_build"] = len(jit.names)
    eng = llm.engine
    row["resolved"] = eng.runner.kda_backends.names
    row["graphs"] = eng.runner.graphs is not None

    # The script's own warm-up (skip it to see whether the engine's startup warm-up suffices).
    if not args.no_script_warmup:
        warm = random_prompts(min(16, args.num_requests), args.input_len, seed=1)
        with TritonCompiles() as jit:
            llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        row["jit_script_warmup"] = len(jit.names)

    prompts = random_prompts(args.num_requests, args.input_len, seed=0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    # With --timed-runs 2 the first run is printed and discarded: the kernels' JIT specializations
    # that the warm-up's shapes did not cover are compiled there, not in the reported run.
    for run in range(args.timed_runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with TritonCompiles() as jit:
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        row["jit_first_run" if run == 0 else "jit_last_run"] = len(jit.names)
        if run + 1 < args.timed_runs:
            s = llm.last_run_stats
            print(f"  {pair}: discarded run {run + 1}: {args.num_requests / wall:.2f} req/s, prefill "
                  f"{s['prefill_tokens_per_s']:.0f} tok/s, decode {s['decode_tokens_per_s']:.0f} tok/s, "
                  f"{len(jit.names)} Triton compiles in the run{': ' + ', '.join(sorted(set(jit.names))) if jit.names else ''}",
                  flush=True)
    n_out = sum(o.num_output_tokens for o in outs)
    assert n_out == args.num_requests * args.output_len, n_out
    s = llm.last_run_stats
    row.update(
        wall_s=wall, req_per_s=args.num_requests / wall, out_tok_per_s=n_out / wall,
        total_tok_per_s=(n_out + args.num_requests * args.input_len) / wall,
        prefill_tok_per_s=s["prefill_tokens_per_s"], decode_tok_per_s=s["decode_tokens_per_s"],
    )
    row.update(decode_step(llm, args))
    del llm, eng, outs
    gc.collect()
    torch.cuda.empty_cache()
    return row


def decode_step(llm: LLM, args) -> dict:
    """Hold `decode_batch` sequences in decode; time a decode step."""
    from triton.testing import do_bench

    eng = llm.engine
    B = args.decode_batch
    ids = [f"decode-{i}" for i in range(B)]
    for rid, p in zip(ids, random_prompts(B, args.input_len, seed=2)):
        eng.add_request(rid, p, SamplingParams(max_tokens=args.output_len + 32, ignore_eos=True))
    started: set[str] = set()
    while len(started) < B:                        # prefill everything (mixed steps included)
        started |= {o.request_id for o in eng.step() if o.new_token_ids}
    host_ms = []
    for _ in range(12):                            # pure decode steps of B sequences
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        host_ms.append((time.perf_counter() - t0) * 1e3)
    out = {"engine_step_us": statistics.median(host_ms[2:]) * 1e3}
    runner = eng.runner
    if runner.graphs is not None and B in runner.graphs.graphs:
        graph = runner.graphs.graphs[B]             # its buffers hold the last step's B real rows
        out["graph_step_us"] = do_bench(graph.replay, return_mode="median") * 1e3
    model = runner.model
    context = args.input_len + 16
    out["weight_MB"] = weight_bytes(model) / 1e6
    out["state_MB"] = 2 * B * state_bytes_per_slot(model) / 1e6
    out["kv_MB"] = B * context * kv_bytes_per_block(model, 1, runner.config.dtype) / 1e6
    for rid in ids:
        eng.abort_request(rid)
    eng.step()
    assert eng.stats()["state_slots_used"] == 0 and eng.stats()["kv_blocks_used"] == 0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="flash+fused,flash+chain,fla+fla",
                    help="comma-separated prefill+decode backend pairs (auto+auto allowed)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--timed-runs", type=int, default=2, help="timed runs of the same requests; the last is reported")
    ap.add_argument("--no-script-warmup", action="store_true",
                    help="skip this script's own warm-up run (with a fresh TRITON_CACHE_DIR: does the engine's warm-up suffice?)")
    # The engine's own flags (--max-model-len is set from the lengths; --kda-*-backend by --pairs).
    add_engine_args(ap, model="bench", max_num_seqs=256, max_num_batched_tokens=8192)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_throughput.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{args.model} model, {args.num_requests} requests x {args.input_len} in / {args.output_len} out, "
          f"max_num_seqs {args.max_num_seqs}, token budget {args.max_num_batched_tokens}; decode step at batch "
          f"{args.decode_batch}")
    rows = []
    for pair in [p.strip() for p in args.pairs.split(",") if p.strip()]:
        t0 = time.perf_counter()
        row = run_pair(pair, args)
        jit = "" if "skipped" in row else (
            f"; engine built in {row['build_s']:.1f} s ({row['jit_build']} Triton compiles, warm-up included), "
            f"compiles in the script warm-up / first / last timed run: {row.get('jit_script_warmup', '-')} / "
            f"{row.get('jit_first_run', '-')} / {row.get('jit_last_run', '-')}")
        what = "skipped: " + row["skipped"] if "skipped" in row else "done"
        print(f"  {pair}: {what} ({time.perf_counter() - t0:.0f} s){jit}", flush=True)
        rows.append(row)

    hdr = (f"{'pair':<14}{'ran as':<14}{'req/s':>7}{'out tok/s':>11}{'tot tok/s':>11}{'prefill t/s':>12}"
           f"{'decode t/s':>11}{'step us':>9}{'eng us':>9}{'floor us':>9}{'+KV us':>8}{'% floor':>8}")
    print("\n" + hdr)
    print("-" * len(hdr))
    for r in rows:
        if "skipped" in r:
            print(f"{r['pair']:<14}skipped: {r['skipped'][:150]}")
            continue
        floor = (r["weight_MB"] + r["state_MB"]) * 1e6 / bw * 1e6
        floor_kv = floor + r["kv_MB"] * 1e6 / bw * 1e6
        step = r.get("graph_step_us")
        print(f"{r['pair']:<14}{r['resolved']:<14}{r['req_per_s']:>7.2f}{r['out_tok_per_s']:>11.0f}{r['total_tok_per_s']:>11.0f}"
              f"{r['prefill_tok_per_s']:>12.0f}{r['decode_tok_per_s']:>11.0f}"
              f"{(f'{step:.0f}' if step else '-'):>9}{r['engine_step_us']:>9.0f}{floor:>9.0f}{floor_kv:>8.0f}"
              f"{(f'{100 * floor_kv / step:.0f}%' if step else '-'):>8}")
    r0 = next((r for r in rows if "skipped" not in r), None)
    if r0:
        print(f"\nfloor = (weights {r0['weight_MB']:.0f} MB + state read+write {r0['state_MB']:.0f} MB) / {bw / 1e12:.2f} TB/s; "
              f"+KV adds {r0['kv_MB']:.0f} MB of K/V reads; % floor = (floor+KV) / graph step time. "
              f"'eng us' is a whole engine step (host metadata, replay, sampling).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
