"""`kdaserve ab`: interleaved A/B of two configurations of one model with an A/A noise estimate
(kdaserve/evidence/ab.py): servers started one at a time, A B B A per round.

    kdaserve ab --model bench --a="--kda-decode-backend fused" --b="--kda-decode-backend chain" --rounds 3
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("ab", help="interleaved A/B of two configurations with an A/A noise estimate",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nano", help="the model both arms serve (default: nano, the trained one)")
    p.add_argument("--a", default="", help='server/engine flags of arm A, one string given with "=" (--a="...")')
    p.add_argument("--b", default="", help='flags of arm B (--b="...")')
    p.add_argument("--rounds", type=int, default=3, help="A B B A rounds (at least 2 for an A/A estimate)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per round (default: 32)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (default: 0)")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to come up (default: 600)")
    p.add_argument("--out", type=Path, default=Path("ab_results"), help="folder for the JSON and the plots")
    p.add_argument("--no-provenance", action="store_true", help="skip the profiled run of each arm")
    p.set_defaults(func=run)


def run(args) -> int:
    from kdaserve.engine.args import engine_kwargs_from_flags
    from kdaserve.evidence import ab

    if args.rounds < 2:
        print("kdaserve ab: --rounds must be at least 2 (the A/A noise needs two A pairs)", file=sys.stderr)
        return 2
    flags = {"A": args.a, "B": args.b}
    try:
        kw = engine_kwargs_from_flags(args.model, args.a), engine_kwargs_from_flags(args.model, args.b)
    except (argparse.ArgumentError, SystemExit) as exc:
        print(f"kdaserve ab: bad arm flags: {exc}", file=sys.stderr)
        return 2
    from kdaserve.models.loader import resolve_model

    # Prompt ids from the config alone: building the model here would hold its memory through the A/B.
    config, tokenizer, _, _ = resolve_model(kw[0]["model"], kw[0]["load_format"], kw[0].get("tokenizer"))
    vocab = min(config.vocab_size, tokenizer.vocab_size, 256)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    prov = {} if args.no_provenance else {arm: ab.provenance(args.model, f, prompts) for arm, f in flags.items()}
    report = ab.run(args.model, flags, prompts, args.output_len, args.rounds, args.max_concurrency,
                    startup_timeout=args.startup_timeout)
    report["provenance"] = prov
    only = ab.distinguishing_kernels(prov) if prov else {}
    report["provenance_only_in_arm"] = only
    for arm in prov:
        names = ", ".join(f"{k['name'][:70]} x{k['calls']}" for k in only[arm][:8]) or "none (the arms ran the same kernels)"
        print(f"{arm}: {prov[arm]['backends']}; {prov[arm]['kind']} only in {arm}: {names}")
    args.out.mkdir(parents=True, exist_ok=True)
    ab.save(report, args.out / "ab.json")
    figures = ab.plots(report, args.out)
    print(f"results: {args.out / 'ab.json'}" + (f"; plots: {', '.join(str(f) for f in figures)}" if figures else ""))
    print(f"\n{args.model}, {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, concurrency "
          f"{args.max_concurrency}, {args.rounds} rounds of A B B A; A = {args.a or '(defaults)'}, B = {args.b or '(defaults)'}")
    print(ab.table(report))
    return 0
