"""`kdaserve generate`: offline batch generation; prints each completion, then prefill and decode
throughput.

    kdaserve generate --prompt "def fibonacci(" --max-tokens 32     # nano, the trained default
    kdaserve generate --model tiny --prompt "Hello" --prompt "KDA is" --max-tokens 32
    kdaserve generate --model bench --prompts-file prompts.txt --ignore-eos
"""

from __future__ import annotations

import json
import sys
import time

from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts and report throughput")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help="a file of prompts: one per line, or a .jsonl file of {\"prompt\": ...} objects")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 is off (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion instead of text "
                   "(stdout holds only those lines; the run's summary goes to stderr)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p, model="nano")   # the trained model shipped in the package
    p.set_defaults(func=run)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            if args.prompts_file.endswith(".jsonl"):
                prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
            else:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


def run(args) -> int:
    from kdaserve.engine import LLM, SamplingParams

    prompts = _read_prompts(args)
    if not prompts:
        print("kdaserve generate: no prompts; give --prompt TEXT (repeatable) or --prompts-file FILE", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs_from_args(args))
        load_s = time.perf_counter() - t0
        if args.chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress and len(prompts) > 1)
    except ValueError as exc:
        print(f"kdaserve generate: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "output_token_ids": out.output_token_ids,
                              "finish_reason": out.finish_reason}, ensure_ascii=False))
        else:
            print(f"--- prompt: {prompt!r}\n{out.text!r}  [{out.num_output_tokens} tokens, {out.finish_reason}]")
    s = llm.last_run_stats
    backends = llm.engine.runner.kda_backends.names if llm.engine.runner.kda_backends else "-"
    summary = sys.stderr if args.json else sys.stdout   # --json: stdout is machine-readable, line by line
    print(
        f"model {llm.engine.model_name} on {llm.engine.config.device} ({str(llm.engine.config.dtype).removeprefix('torch.')}), "
        f"KDA backends {backends}, loaded in {load_s:.1f} s\n"
        f"prefill: {s['prefill_tokens']} tokens in {s['prefill_time_s']:.3f} s = {s['prefill_tokens_per_s']:.1f} tok/s\n"
        f"decode:  {s['decode_tokens']} tokens in {s['decode_time_s']:.3f} s = {s['decode_tokens_per_s']:.1f} tok/s",
        file=summary,
    )
    if "spec_decode_num_drafts" in s:
        rate, length = s["spec_decode_acceptance_rate"], s["spec_decode_mean_acceptance_length"]
        print(f"speculative: {s['spec_decode_num_draft_tokens']} draft tokens in {s['spec_decode_num_drafts']} drafts, "
              f"{s['spec_decode_num_accepted_tokens']} accepted"
              + (f" (acceptance rate {rate:.1%}, mean acceptance length {length:.2f})" if rate is not None else ""),
              file=summary)
    return 0
