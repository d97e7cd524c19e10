"""Paired accuracy between two configurations of one model (`kdaserve accuracy`): the same tasks
under both, compared pair by pair.

- Teacher forcing: the log-probability of every gold continuation token under A and under B
  (prompt log-probs of prompt + gold); reported as the distribution of |A - B| per token and the
  paired difference of each task's mean log-prob.
- Task accuracy: greedy completion of the gold line (next-line completion: a source line from
  its preceding lines), exact match after stripping; McNemar's exact test on the tasks one arm
  gets right and the other wrong, and the greedy agreement rate (same completion text).

An arm is an engine built from flags (run one at a time: two models need not fit together) or a
running server (`/v1/completions`; echo + logprobs for teacher forcing)."""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kdaserve.evidence.stats import distribution, mcnemar_exact, paired_difference


@dataclass
class Task:
    prompt: list[int]
    gold: list[int]      # the gold continuation's tokens (the line, without its newline)
    gold_text: str


def held_out(path: Path, root: Path) -> bool:
    """The nano model's split (tools/train_nano.py): a file is held out when the SHA-256 of its
    path relative to the stdlib directory is 0 mod 20."""
    return int(hashlib.sha256(str(path.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0


def stdlib_held_out_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and held_out(p, root))


def next_line_tasks(files: list[Path], encode, n: int, context_lines: int = 8, max_prompt_tokens: int = 512,
                    seed: int = 0) -> list[Task]:
    """`n` tasks: a line of at least 3 non-blank characters after `context_lines` lines of its file."""
    candidates = []
    for f in files:
        lines = f.read_text(errors="replace").split("\n")
        candidates += [(lines, i) for i in range(context_lines, len(lines)) if len(lines[i].strip()) >= 3]
    rng = random.Random(seed)
    rng.shuffle(candidates)
    tasks = []
    for lines, i in candidates:
        prompt = encode("\n".join(lines[i - context_lines : i]) + "\n")[-max_prompt_tokens:]
        gold = encode(lines[i])
        if gold:
            tasks.append(Task(prompt, gold, lines[i]))
        if len(tasks) == n:
            break
    return tasks


class EngineArm:
    """Both measurements through an in-process engine (kdaserve.engine.LLM)."""

    def __init__(self, name: str, llm):
        self.name, self.llm = name, llm

    def score(self, tasks: list[Task]) -> list[list[float]]:
        from kdaserve.engine import SamplingParams

        outs = self.llm.generate([t.prompt + t.gold for t in tasks], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)
        return [[e["logprob"] for e in o.prompt_logprobs[len(t.prompt):]] for t, o in zip(tasks, outs)]

    def complete(self, tasks: list[Task], max_tokens: int) -> list[str]:
        from kdaserve.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])
        return [o.text for o in self.llm.generate([t.prompt for t in tasks], params, use_tqdm=False)]


class ServerArm:
    """Both measurements through a running server's `/v1/completions` (token-id prompts)."""

    def __init__(self, name: str, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name, self.model = name, model
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, body: dict) -> dict:
        r = self.client.post("/v1/completions", json={"model": self.model, **body} if self.model else body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:300]}")
        return r.json()

    def encode(self, text: str) -> list[int]:
        """The server's own tokenization (`/tokenize`): its model's tokenizer, whatever it is."""
        r = self.client.post("/tokenize", json={"prompt": text, **({"model": self.model} if self.model else {})})
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: /tokenize {r.status_code} {r.text[:300]}")
        return r.json()["tokens"]

    def score(self, tasks: list[Task]) -> list[list[float]]:
        out = []
        for t in tasks:
            lp = self._post({"prompt": t.prompt + t.gold, "max_tokens": 0, "echo": True, "logprobs": 0,
                             "temperature": 0})["choices"][0]["logprobs"]["token_logprobs"]
            out.append(lp[len(t.prompt) : len(t.prompt) + len(t.gold)])
        return out

    def complete(self, tasks: list[Task], max_tokens: int) -> list[str]:
        return [self._post({"prompt": t.prompt, "max_tokens": max_tokens, "temperature": 0, "stop": ["\n"]})
                ["choices"][0]["text"] for t in tasks]


def measure(arm, tasks: list[Task], max_tokens: int) -> dict:
    return {"name": arm.name, "logprobs": arm.score(tasks), "completions": arm.complete(tasks, max_tokens)}


def compare(a: dict, b: dict, tasks: list[Task]) -> dict:
    """The paired report of two arms' measurements on the same tasks."""
    abs_diffs = [abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb)]
    mean_a = [sum(la) / len(la) for la in a["logprobs"]]
    mean_b = [sum(lb) / len(lb) for lb in b["logprobs"]]
    right_a = [c.strip() == t.gold_text.strip() for c, t in zip(a["completions"], tasks)]
    right_b = [c.strip() == t.gold_text.strip() for c, t in zip(b["completions"], tasks)]
    only_a = sum(x and not y for x, y in zip(right_a, right_b))
    only_b = sum(y and not x for x, y in zip(right_a, right_b))
    diff = paired_difference(mean_a, mean_b)
    return {
        "arms": [a["name"], b["name"]], "tasks": len(tasks), "gold_tokens": len(abs_diffs),
        "token_logprob_abs_diff": distribution(abs_diffs),
        "task_mean_logprob": {"a": sum(mean_a) / len(mean_a), "b": sum(mean_b) / len(mean_b),
                              "b_minus_a": diff.mean, "se": diff.se, "ci95": [diff.low, diff.high]},
        "exact_match": {"a": sum(right_a) / len(tasks), "b": sum(right_b) / len(tasks), "only_a": only_a,
                        "only_b": only_b, "mcnemar_p": mcnemar_exact(only_a, only_b)},
        "greedy_agreement": sum(x == y for x, y in zip(a["completions"], b["completions"])) / len(tasks),
    }


def report_table(r: dict) -> str:
    d, em, lp = r["token_logprob_abs_diff"], r["exact_match"], r["task_mean_logprob"]
    rows = [
        "| measure | A | B | paired |",
        "|---|---|---|---|",
        f"| mean log-prob per gold token | {lp['a']:.4f} | {lp['b']:.4f} | B-A {lp['b_minus_a']:+.2e} "
        f"(95% CI {lp['ci95'][0]:+.2e} .. {lp['ci95'][1]:+.2e}) |",
        f"| abs log-prob difference per token | | | mean {d.get('mean', 0):.2e}, p99 {d.get('p99', 0):.2e}, "
        f"max {d.get('max', 0):.2e} ({d['n']} tokens) |",
        f"| next-line exact match | {em['a']:.1%} | {em['b']:.1%} | only A {em['only_a']}, only B {em['only_b']}, "
        f"McNemar p = {em['mcnemar_p']:.3g} |",
        f"| greedy agreement | | | {r['greedy_agreement']:.1%} of {r['tasks']} tasks |",
    ]
    return "\n".join(rows)


def save(r: dict, path: Path) -> None:
    path.write_text(json.dumps(r, indent=1))
