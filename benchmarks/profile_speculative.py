"""Where a verify step's time goes, next to a plain decode step: the engine's host phases and the
graph replay's device time, per batch size (the `bench` model by default, random prompts, every
draft right so every verify carries S drafts).

    python benchmarks/profile_speculative.py --batches 1 8 32

Phases (host wall time, with a device sync around the replay so each phase is its own): propose
(prompt lookup), schedule, host step (metadata on the host), replay (the CUDA graph, device time
by CUDA events), logits (the LM head on the sampled rows, device time), sample (sampling and the
read back), apply (a verify's tokens into the requests), execute (the runner's whole step). Prints one table, medians of
`--steps` steps after `--skip` warm steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.engine import model_runner as mr  # noqa: E402
from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args  # noqa: E402
from kdaserve.testing.speculative import ScriptedProposer  # noqa: E402

PHASES = ("propose", "schedule", "host step", "replay", "logits", "sample", "apply", "execute", "engine step")


class Timers:
    def __init__(self):
        self.t: dict[str, list[float]] = {p: [] for p in PHASES}

    def wrap(self, obj, name: str, phase: str, device: bool = False):
        real = getattr(obj, name)

        def timed(*a, **kw):
            if device:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = real(*a, **kw)
                end.record()
                torch.cuda.synchronize()
                self.t[phase].append(start.elapsed_time(end) * 1e3)
                return out
            t0 = time.perf_counter()
            out = real(*a, **kw)
            self.t[phase].append((time.perf_counter() - t0) * 1e6)
            return out

        setattr(obj, name, timed)


def profile(engine_kw: dict, batch: int, spec: dict | None, args) -> dict:
    llm = LLM(**engine_kw, speculative_config=spec)
    eng, runner = llm.engine, llm.engine.runner
    vocab = eng.vocab_size
    prompts = [[(97 * i + 31 * t) % vocab for t in range(args.input_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=args.skip + args.steps + 8, ignore_eos=True)
    if spec is not None:   # every draft right: the plain run's tokens
        want = [o.output_token_ids for o in LLM(**engine_kw).generate(prompts, params, use_tqdm=False)]
        eng.proposer = ScriptedProposer({tuple(p): w for p, w in zip(prompts, want)}, spec["num_speculative_tokens"])
    timers = Timers()
    if spec is not None:
        timers.wrap(eng, "_propose_drafts", "propose")
    timers.wrap(eng.scheduler, "schedule", "schedule")
    timers.wrap(mr, "build_host_step", "host step")
    if runner.graphs is not None:
        timers.wrap(runner.graphs, "run", "replay", device=True)
    timers.wrap(runner.model, "compute_logits", "logits", device=torch.cuda.is_available())
    sampler = runner.rejection_sampler if spec is not None else runner.sampler
    timers.wrap(sampler, "sample", "sample")
    timers.wrap(runner, "execute", "execute")
    if spec is not None:
        timers.wrap(eng, "_apply_verified", "apply")
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    steps = 0
    while eng.has_unfinished_requests() and steps < args.skip + args.steps:
        if all(s.num_computed_tokens > 0 and s.num_uncomputed_tokens == 1 for s in eng.scheduler.running) \
                and len(eng.scheduler.running) == batch:
            if steps == args.skip:
                for v in timers.t.values():
                    v.clear()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            timers.t["engine step"].append((time.perf_counter() - t0) * 1e6)
            steps += 1
        else:
            eng.step()
    tokens = eng.spec_stats.mean_acceptance_length if spec is not None else 1.0
    out = {p: statistics.median(v) if v else 0.0 for p, v in timers.t.items()}
    out["tokens per step"] = tokens or 1.0
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    add_engine_args(p, model="bench", max_model_len=1024)
    args = p.parse_args()
    kw = engine_kwargs_from_args(args)
    kw.pop("speculative_config", None)
    kw["max_num_seqs"] = max(args.batches)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": 1}
    rows = []
    for b in args.batches:
        for label, s in (("plain", None), (f"verify k={args.num_speculative_tokens}", spec)):
            r = profile(kw, b, s, args)
            rows.append((b, label, r))
            print(f"  batch {b} {label}: engine step {r['engine step']:.0f} us", flush=True)
    print(f"\nmedian µs per step, model {kw['model']}, {args.input_len}-token prompts, oracle drafts")
    print("| batch | step | " + " | ".join(PHASES) + " | tokens per step | µs per token |")
    print("|---|---|" + "---|" * (len(PHASES) + 2))
    for b, label, r in rows:
        print(f"| {b} | {label} | " + " | ".join(f"{r[p]:.0f}" for p in PHASES)
              + f" | {r['tokens per step']:.2f} | {r['engine step'] / r['tokens per step'] / b:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
