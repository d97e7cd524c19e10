"""Host time of structured output's per-step mask fill: xgrammar's bitmask for R rows over a
vocabulary of Kimi-Linear's size, one row at a time (GrammarMatcher.fill_next_token_bitmask)
against the batch fill on several threads (BatchGrammarMatcher, what the engine uses), for a
JSON schema at its start and inside a string (where most tokens are allowed and the fill is
slowest). The vocabulary is synthetic (random byte strings; no tokenizer files here). CPU only.

    python benchmarks/bench_grammar_fill.py --rows 1 8 32 --vocab 163840
"""

from __future__ import annotations

import argparse
import random
import time

import xgrammar as xgr

SCHEMA = '{"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer"}},"required":["name","n"]}'


def vocabulary(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]\":,._-\n"
    vocab, seen = [bytes([i]) for i in range(256)], set()
    while len(vocab) < size - 256:
        t = bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    return vocab + [b""] * (size - len(vocab))   # special tokens


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    info = xgr.TokenizerInfo(vocabulary(args.vocab), xgr.VocabType.RAW, vocab_size=args.vocab, stop_token_ids=[args.vocab - 1])
    grammar = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA)
    batch = xgr.BatchGrammarMatcher(max_threads="auto")
    rows_out = []
    for state, prefix in (("start", ""), ("inside a string", '{"name": "ab')):
        for r in args.rows:
            ms = [xgr.GrammarMatcher(grammar) for _ in range(r)]
            for m in ms:
                if prefix:
                    m.accept_string(prefix)
            bm = xgr.allocate_token_bitmask(r, args.vocab)
            one = timed(lambda: [m.fill_next_token_bitmask(bm, i) for i, m in enumerate(ms)], args.repeats)
            many = timed(lambda: batch.batch_fill_next_token_bitmask(ms, bm), args.repeats)
            rows_out.append((state, r, one * 1e6, many * 1e6))
    print(f"\nmask fill, vocabulary {args.vocab}, µs per step (all rows)")
    print("| grammar state | rows | one by one | batch (threads) | speedup |")
    print("|---|---|---|---|---|")
    for state, r, one, many in rows_out:
        print(f"| {state} | {r} | {one:.0f} | {many:.0f} | {one / many:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
