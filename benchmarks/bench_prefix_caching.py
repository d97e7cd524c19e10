"""Prefix caching: time to first token and prompt tokens computed, with and without
`--enable-prefix-caching`, on one engine configuration (default: the `bench` model on a GPU, the
`tiny` model on a CPU, where the token counts are the point).

    python benchmarks/bench_prefix_caching.py                                  # 2K and 8K system prompts, 4-turn chat
    python benchmarks/bench_prefix_caching.py --system-lens 2048 --model tiny --device cpu

Workloads (random token ids; each request generates `--output-len` tokens):
- `system N`: `--requests` requests share an N-token system prompt and add a `--user-len`-token
  turn of their own. The first request fills the cache and is not timed; the others run one at a
  time (time to first token: a 1-token request's wall time) and then all together (throughput).
- `chat`: `--turns` turns, the first a system prompt (the first of `--system-lens`) and a user
  turn, each later prompt the previous prompt + its answer + a new user turn; the
  chat is run once to make the turns, then again in order (TTFT of turns 2.. from the engine's
  timestamps).
- `no hits`: random prompts that share nothing, all together: what caching costs when nothing
  hits (the chunk cuts at checkpoint boundaries, the state copies, the hashing).

One engine per setting, built in turn in one process, each warmed up by a first pass of the same
shapes on other token ids. Prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ids(rng, n, vocab):
    return [rng.randrange(1, vocab) for _ in range(n)]


def timed_generate(llm, prompts, params):
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return outs, time.perf_counter() - t0


def run_setting(engine_kw, cache: bool, args, vocab) -> list[dict]:
    llm = LLM(**engine_kw, enable_prefix_caching=cache)
    eng = llm.engine
    rows = []
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    gen = SamplingParams(max_tokens=args.output_len, ignore_eos=True)

    def measure(name, first, rest, together=True):
        """`first` fills the cache (untimed); `rest` one at a time (TTFT), then together."""
        llm.generate([first], one, use_tqdm=False)
        before = eng.counters["prompt_tokens"]
        ttft = [timed_generate(llm, [p], one)[1] for p in rest]
        computed = eng.counters["prompt_tokens"] - before
        row = {"workload": name, "cache": cache, "ttft_ms": 1e3 * statistics.median(ttft),
               "prompt_tokens": sum(map(len, rest)), "computed": computed, "req_s": None}
        if together:
            _, wall = timed_generate(llm, rest, gen)
            row["req_s"] = len(rest) / wall
        rows.append(row)

    for n in args.system_lens:
        for seed in (1, 2):   # seed 1 warms this shape up on other tokens; seed 2 is measured
            rng = random.Random(seed)
            system = ids(rng, n, vocab)
            prompts = [system + ids(rng, args.user_len, vocab) for _ in range(args.requests + 1)]
            if seed == 1:
                llm.generate(prompts[:2], one, use_tqdm=False)
                continue
            measure(f"system {n}", prompts[0], prompts[1:])
    rng = random.Random(3)
    prompt, turns = ids(rng, args.system_lens[0] + args.user_len, vocab), []
    for _ in range(args.turns):
        turns.append(prompt)
        answer = llm.generate([prompt], gen, use_tqdm=False)[0].output_token_ids
        prompt = prompt + answer + ids(rng, args.user_len, vocab)
    if cache:
        llm.engine.reset_prefix_cache()
    before = eng.counters["prompt_tokens"]
    ttft = []
    for t in turns:   # the chat again, in order, answers included: each turn can reuse the one before
        m = llm.generate([t], gen, use_tqdm=False)[0].metrics
        ttft.append(m["first_token_time"] - m["arrival_time"])
    rows.append({"workload": f"chat, {args.turns} turns", "cache": cache, "ttft_ms": 1e3 * statistics.median(ttft[1:]),
                 "prompt_tokens": sum(map(len, turns)), "computed": eng.counters["prompt_tokens"] - before, "req_s": None})
    rng = random.Random(4)
    fresh = [ids(rng, args.system_lens[-1] + args.user_len, vocab) for _ in range(args.requests)]
    llm.generate(fresh[:2], gen, use_tqdm=False)
    fresh = [ids(rng, args.system_lens[-1] + args.user_len, vocab) for _ in range(args.requests)]
    before = eng.counters["prompt_tokens"]
    _, wall = timed_generate(llm, fresh, gen)
    rows.append({"workload": "no hits", "cache": cache, "ttft_ms": None, "prompt_tokens": sum(map(len, fresh)),
                 "computed": eng.counters["prompt_tokens"] - before, "req_s": len(fresh) / wall})
    llm = eng = None   # free the engine before the next configuration (rebound: measure() names them)
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--passes", type=int, default=2, help="alternating off/on passes (each builds both engines)")
    gpu = torch.cuda.is_available()
    add_engine_args(p, model="bench" if gpu else "tiny", max_model_len=16384)
    args = p.parse_args()
    engine_kw = engine_kwargs_from_args(args)
    engine_kw.pop("enable_prefix_caching", None)
    vocab = min(LLM(**{**engine_kw, "max_num_seqs": 1, "warmup": False, "enforce_eager": True}).engine.vocab_size, 256)
    rows = []
    for rep in range(args.passes):   # off, on, off, on, ...: a drift between engines shows as a spread
        for cache in (False, True):
            rows += [dict(r, rep=rep + 1) for r in run_setting(engine_kw, cache, args, vocab)]
    print(f"\nprefix caching, model {engine_kw['model']}, {args.requests} requests, user turns {args.user_len} tokens, "
          f"{args.output_len} out, checkpoint every {engine_kw.get('mamba_block_size') or 32 * engine_kw['block_size']} tokens")
    print("| workload | caching | pass | TTFT ms (median) | prompt tokens | computed | req/s together |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["workload"], r["cache"], r["rep"])):
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        rs = f"{r['req_s']:.2f}" if r["req_s"] is not None else "-"
        print(f"| {r['workload']} | {'on' if r['cache'] else 'off'} | {r['rep']} | {ttft} | {r['prompt_tokens']} | "
              f"{r['computed']} | {rs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
