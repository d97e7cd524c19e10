"""Decode throughput with and without speculative decoding (prompt lookup), per batch size and
workload, on one engine configuration (default: the `bench` model, CUDA graphs).

    python benchmarks/bench_speculative.py                                   # batches 1 8 32, k = 4
    python benchmarks/bench_speculative.py --batches 1 8 --num-speculative-tokens 2 --model kimi-tiny

Workloads (each request: `--input-len` prompt tokens, exactly `--output-len` output tokens):
- `repeat`: prompts that quote earlier text (a random span of 64 tokens repeated);
- `random`: random prompts, where prompt lookup rarely finds anything or its drafts are wrong;
- `oracle`: drafts that are always right (the plain run's own tokens, proposed by a scripted
  proposer): the ceiling of what speculation can give on this card at this batch, and the cost of
  a verify step when every draft is accepted.

With random weights (the `bench` model, `--load-format dummy`) the model does not copy its prompt,
so `repeat` accepts little more than `random`: its acceptance rate is the model's, not the
method's. Each row: one engine for plain decoding and one with speculation, built in turn (the
plain one first), each warmed up by a first run of the same requests; the timed run is the second.
Decode time = the engine steps without prompt tokens; tokens per sequence-step = decode tokens /
decode steps / batch (1 without speculation, up to k+1 with it); "same tokens" = the share of
output positions where the speculative run's token equals the plain run's (greedy: 100% in exact
arithmetic; bf16 rounding differs between a verify step and a decode step and can flip near-ties,
after which the two texts go their own ways). Prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args  # noqa: E402
from kdaserve.testing.speculative import ScriptedProposer  # noqa: E402


def prompts_for(workload: str, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if workload == "repeat":
        out = []
        for _ in range(n):
            span = [rng.randrange(vocab) for _ in range(64)]
            out.append((span * (length // 64 + 1))[:length])
        return out
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def timed(llm: LLM, prompts, params) -> tuple[list, dict]:
    llm.generate(prompts, params, use_tqdm=False)              # warm-up: same shapes, compiles
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.output_token_ids for o in outs], dict(llm.last_run_stats)


def run(args, engine_kw: dict, batch: int, workload: str, vocab: int) -> dict:
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    prompts = prompts_for("random" if workload == "oracle" else workload, batch, args.input_len, vocab, args.seed)
    plain = LLM(**engine_kw)
    want, base = timed(plain, prompts, params)
    steps_plain = plain.engine.counters["steps"]
    del plain
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    llm = LLM(**engine_kw, speculative_config=spec)
    if workload == "oracle":
        llm.engine.proposer = ScriptedProposer({tuple(p): w for p, w in zip(prompts, want)}, args.num_speculative_tokens)
    got, s = timed(llm, prompts, params)
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    same = sum(a == b for x, y in zip(want, got) for a, b in zip(x, y)) / max(1, sum(map(len, want)))
    return {
        "batch": batch, "workload": workload,
        "plain": base["decode_tokens_per_s"], "spec": s["decode_tokens_per_s"],
        "rate": s.get("spec_decode_acceptance_rate"), "length": s.get("spec_decode_mean_acceptance_length"),
        "same": same, "steps_plain": steps_plain,
        "plain_step_us": 1e6 * base["decode_time_s"] / max(1, base["decode_steps"]),
        "spec_step_us": 1e6 * s["decode_time_s"] / max(1, s["decode_steps"]),
        "tokens_per_step": s["decode_tokens"] / max(1, s["decode_steps"]) / batch,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--workloads", nargs="+", default=["repeat", "random", "oracle"], choices=["repeat", "random", "oracle"])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    add_engine_args(p, model="bench", max_model_len=1024)
    args = p.parse_args()
    engine_kw = engine_kwargs_from_args(args)
    engine_kw.pop("speculative_config", None)
    engine_kw["max_num_seqs"] = max(args.batches)
    probe = LLM(**{**engine_kw, "max_num_seqs": 1, "warmup": False, "enforce_eager": True})
    vocab = probe.engine.vocab_size
    del probe
    rows = []
    for batch in args.batches:
        for workload in args.workloads:
            r = run(args, engine_kw, batch, workload, vocab)
            rows.append(r)
            print(f"  batch {batch} {workload}: plain {r['plain']:.0f} tok/s, speculative {r['spec']:.0f} tok/s", flush=True)
    k = args.num_speculative_tokens
    print(f"\ndecode tok/s, {args.input_len} in / {args.output_len} out, k = {k}, "
          f"prompt lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, model {engine_kw['model']}")
    print("| batch | workload | plain tok/s | speculative tok/s | speedup | acceptance rate | mean acceptance length "
          "| tokens per sequence-step | plain step µs | verify step µs | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['rate']:.1%}" if r["rate"] is not None else "no drafts"
        length = f"{r['length']:.2f}" if r["length"] is not None else "-"
        print(f"| {r['batch']} | {r['workload']} | {r['plain']:.0f} | {r['spec']:.0f} | {r['spec'] / r['plain']:.2f}x | "
              f"{rate} | {length} | {r['tokens_per_step']:.2f} | {r['plain_step_us']:.0f} | {r['spec_step_us']:.0f} | "
              f"{r['same']:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
