"""`kdaserve accuracy`: paired accuracy of two configurations of one model (kdaserve/evidence/accuracy.py).

    kdaserve accuracy --stdlib-held-out --b="--mamba-ssm-cache-dtype bfloat16"
    kdaserve accuracy --a-url http://localhost:8000 --b-url http://localhost:8001 --data held_out/*.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("accuracy", help="paired accuracy of two configurations (teacher-forced log-probs, McNemar)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nano", help="the model both engine arms run (default: nano, the trained one)")
    p.add_argument("--a", default="",
                   help='engine flags of arm A, one string given with "=" (--a="--kda-decode-backend reference")')
    p.add_argument("--b", default="", help='engine flags of arm B (--b="...")')
    p.add_argument("--a-url", help="arm A is the server at this URL instead of an engine")
    p.add_argument("--b-url", help="arm B is the server at this URL instead of an engine")
    p.add_argument("--served-model-name", help="the model name to send to servers")
    p.add_argument("--api-key", help="Bearer key for the servers")
    p.add_argument("--data", nargs="*", type=Path, default=[], help="source files the next-line tasks come from")
    p.add_argument("--stdlib-held-out", action="store_true",
                   help="tasks from the Python stdlib files the nano model was not trained on")
    p.add_argument("--num-tasks", type=int, default=100, help="next-line tasks drawn from the files (default: 100)")
    p.add_argument("--context-lines", type=int, default=8, help="lines of context before each task's line (default: 8)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longest task prompt in tokens (default: 512)")
    p.add_argument("--score-chunk-tokens", type=int, default=16,
                   help="engine arms prefill in steps of this many tokens (their --max-num-batched-tokens unless "
                        "the arm sets it), so the recurrent state is stored and read back in its dtype between "
                        "chunks, as in serving; in one chunk a --mamba-ssm-cache-dtype difference never shows "
                        "(default: 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a completion may take (it stops at a newline)")
    p.add_argument("--seed", type=int, default=0, help="which tasks are drawn (default: 0)")
    p.add_argument("--json", type=Path, help="write the whole report here")
    p.set_defaults(func=run)


def run(args) -> int:
    from kdaserve.engine.args import engine_kwargs_from_flags
    from kdaserve.evidence import accuracy as acc

    if args.score_chunk_tokens < 1:
        print(f"kdaserve accuracy: --score-chunk-tokens must be >= 1, got {args.score_chunk_tokens}", file=sys.stderr)
        return 2
    files = list(args.data) + (acc.stdlib_held_out_files() if args.stdlib_held_out else [])
    if not files:
        print("kdaserve accuracy: no task files: give --data FILES or --stdlib-held-out", file=sys.stderr)
        return 2
    try:
        arms_kw = [None if url else engine_kwargs_from_flags(args.model, flags) for url,
                   flags in ((args.a_url, args.a), (args.b_url, args.b))]
    except (argparse.ArgumentError, SystemExit) as exc:
        print(f"kdaserve accuracy: bad arm flags: {exc}", file=sys.stderr)
        return 2
    encode = None
    results = []
    tasks = None
    for name, url, kw in (("A", args.a_url, arms_kw[0]), ("B", args.b_url, arms_kw[1])):
        llm = None
        if url:
            arm = acc.ServerArm(f"{name} {url}", url, args.served_model_name, args.api_key)
            encode = encode or arm.encode   # the tasks' token ids come from the model's own tokenizer
        else:
            from kdaserve.engine import LLM

            if kw.get("max_num_batched_tokens") is None:
                kw["max_num_batched_tokens"] = args.score_chunk_tokens
            llm = LLM(**kw)
            encode = encode or llm.tokenizer.encode
            flags = args.a if name == "A" else args.b
            arm = acc.EngineArm(f"{name} {flags or '(defaults)'}", llm)
        if tasks is None:
            tasks = acc.next_line_tasks(files, encode, args.num_tasks, args.context_lines,
                                        args.max_prompt_tokens, args.seed)
            if not tasks:
                print("kdaserve accuracy: the files hold no usable lines", file=sys.stderr)
                return 2
        results.append(acc.measure(arm, tasks, args.max_tokens))
        del llm
    report = acc.compare(results[0], results[1], tasks)
    if args.json:
        acc.save(report, args.json)
    print(f"\n{report['tasks']} next-line tasks, {report['gold_tokens']} gold tokens; A = {report['arms'][0]}, "
          f"B = {report['arms'][1]}")
    print(acc.report_table(report))
    return 0
