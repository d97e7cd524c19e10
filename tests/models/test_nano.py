"""The shipped nano checkpoint (kdaserve/models/nano): it loads under its name, it is trained (its
loss on Python text is far below the same architecture with random weights), and its greedy output
for fixed prompts is pinned, so a change that alters what the README's default prints shows here."""

from __future__ import annotations

import math

import pytest

from kdaserve.engine import LLM, SamplingParams

# Python the model never saw in training (written for this test), in the standard library's style.
TEXT = '''def _unquote(value):
    """Return the string without its surrounding quotes."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\\"":
        return value[1:-1]
    return value


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''


def _nats_per_byte(llm: LLM) -> float:
    ids = llm.engine.tokenizer.encode(TEXT)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    scored = [e["logprob"] for e in out.prompt_logprobs[1:]]
    return -sum(scored) / len(scored)


@pytest.fixture(scope="module")
def nano():
    return LLM("nano", device="cpu", max_model_len=1024)


def test_nano_is_a_trained_checkpoint(nano):
    assert nano.engine.model_name == "nano" and nano.engine.runner.model.config.model_type == "kimi_linear"
    trained = _nats_per_byte(nano)
    random = _nats_per_byte(LLM("nano", device="cpu", max_model_len=1024, load_format="dummy"))
    # Training reached 0.79 nats/byte on held-out stdlib files; random weights sit near ln(260) = 5.56.
    assert trained < 1.5 and random > 4.0, (trained, random)
    assert math.isfinite(trained)


def test_nano_greedy_output_is_pinned(nano):
    outs = nano.generate(["def fibonacci(", "import os\n"], SamplingParams(max_tokens=24, temperature=0),
                         use_tqdm=False)
    assert [o.text for o in outs] == ['file, args):\n        """', "import sys\nimport sys\nim"]
