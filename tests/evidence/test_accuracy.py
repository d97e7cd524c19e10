"""`kdaserve accuracy` on the tiny model (CPU): an A/A pair shows no difference and full
agreement; a planted difference (bf16 weights in B) shows in the log-probs; the command writes
its JSON and table; the nano split is the training tool's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdaserve.engine import LLM
from kdaserve.evidence import accuracy as acc

REF = dict(device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=1024)
FILES = [Path(acc.__file__), Path(acc.__file__).with_name("stats.py")]


@pytest.fixture(scope="module")
def tasks():
    from kdaserve.models.tokenizer import ByteTokenizer

    return acc.next_line_tasks(FILES, ByteTokenizer().encode, 10, context_lines=4, max_prompt_tokens=200)


def test_tasks_are_lines_after_their_context(tasks):
    assert len(tasks) == 10
    for t in tasks:
        assert bytes(t.gold).decode() == t.gold_text and len(t.gold_text.strip()) >= 3
        assert bytes(t.prompt).decode().endswith("\n") and len(t.prompt) <= 200


def test_aa_is_identical_and_a_planted_difference_shows(tasks):
    a = acc.measure(acc.EngineArm("A", LLM("tiny", **REF)), tasks, 16)
    a2 = acc.measure(acc.EngineArm("A again", LLM("tiny", **REF)), tasks, 16)
    same = acc.compare(a, a2, tasks)
    assert same["token_logprob_abs_diff"]["max"] == 0.0 and same["greedy_agreement"] == 1.0
    assert same["exact_match"]["mcnemar_p"] == 1.0
    b = acc.measure(acc.EngineArm("B bf16", LLM("tiny", **{**REF, "dtype": "bfloat16"})), tasks, 16)
    diff = acc.compare(a, b, tasks)
    assert diff["token_logprob_abs_diff"]["max"] > 1e-3, diff["token_logprob_abs_diff"]
    assert diff["gold_tokens"] == sum(len(t.gold) for t in tasks)
    assert "McNemar p" in acc.report_table(diff)


def test_the_command_writes_json_and_a_table(tmp_path, capsys):
    from kdaserve.cli import main

    flags = "--device cpu --kda-prefill-backend reference --kda-decode-backend reference --max-model-len 1024"
    out = tmp_path / "r.json"
    assert main(["accuracy", f"--a={flags}", f"--b={flags} --dtype bfloat16", "--data", *map(str, FILES),
                 "--num-tasks", "4", "--max-tokens", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tasks"] == 4 and set(r) >= {"token_logprob_abs_diff", "exact_match", "greedy_agreement"}
    assert "| next-line exact match |" in capsys.readouterr().out
    assert main(["accuracy", "--a=--no-such-flag", "--data", str(FILES[0])]) == 2


def test_the_split_is_the_training_tools():
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = acc.stdlib_held_out_files()
    assert files and all(int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0 for p in files)


def test_the_state_dtype_shows_because_prompts_are_scored_in_chunks(tmp_path):
    """README's example compares the stored state's dtype: prefilled in one chunk the state is never
    stored between a prompt's tokens, so the difference is exactly 0; in chunks of 16 tokens (the
    default) it is stored and read back in bf16 between them, as in serving."""
    from kdaserve.cli import main

    flags = "--device cpu --kda-prefill-backend reference --kda-decode-backend reference --max-model-len 1024"

    def max_diff(*extra):
        out = tmp_path / "r.json"
        assert main(["accuracy", f"--a={flags}", f"--b={flags} --mamba-ssm-cache-dtype bfloat16", "--data",
                     str(FILES[0]), "--num-tasks", "3", "--max-tokens", "4", "--max-prompt-tokens", "128", "--json",
                     str(out), *extra]) == 0
        return json.loads(out.read_text())["token_logprob_abs_diff"]["max"]

    assert max_diff() > 0
    assert max_diff("--score-chunk-tokens", "4096") == 0.0   # one chunk per text: the state dtype never matters
    assert main(["accuracy", "--score-chunk-tokens", "0", "--data", str(FILES[0])]) == 2
