"""Host time of incremental detokenization per output token: the window path (two decodes per
call) against `tokenizers`' DecodeStream (engine/detokenizer.py), one token per call as the
engine streams, same process, alternating, median of rounds. Tokenizers: the nano model's
(byte-level, 260 ids) and a byte-level BPE with merges trained here on Python's standard library
(32K ids; no download).

    PYTHONPATH=$PWD python benchmarks/bench_detokenizer.py [--tokens 3000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import kdaserve  # noqa: E402
from kdaserve.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from kdaserve.models.tokenizer import HFTokenizer, load_checkpoint_tokenizer  # noqa: E402


class WindowOnly:
    def __init__(self, tok):
        self.tok, self.vocab_size = tok, tok.vocab_size

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stdlib_bpe(files: list[str]) -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return HFTokenizer("unused", eos_token_id=0, tokenizer=tok)


def per_token_us(tok, ids: list[int]) -> float:
    d = IncrementalDetokenizer(tok, [])
    t0 = time.perf_counter()
    for end in range(1, len(ids) + 1):
        d.add(ids, end=end)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))
    text = "".join(open(f, encoding="utf-8").read() for f in files[-20:]) + " ünïcödé 日本語 🎉" * 50
    toks = {"nano (bytes)": load_checkpoint_tokenizer(Path(kdaserve.__file__).parent / "models" / "nano"),
            "stdlib BPE (32K)": stdlib_bpe(files[:150])}
    print("| tokenizer | window µs/token | DecodeStream µs/token | window / stream |")
    print("|---|---|---|---|")
    for name, tok in toks.items():
        ids = tok.encode(text)[: args.tokens]
        window, stream = [], []
        for _ in range(args.rounds):
            window.append(per_token_us(WindowOnly(tok), ids))
            stream.append(per_token_us(tok, ids))
        w, s = statistics.median(window), statistics.median(stream)
        print(f"| {name} | {w:.2f} | {s:.2f} | {w / s:.2f}x |")


if __name__ == "__main__":
    main()
