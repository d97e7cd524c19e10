"""vLLM flags typed by habit (engine/vllm_flags.py): every engine command takes them; each is
accepted with a note where it changes nothing, or refused with why and what to use, never a bare
"unrecognized arguments"."""

import pytest

from kdaserve.cli import build_parser
from kdaserve.engine.args import engine_kwargs_from_args
from kdaserve.engine.vllm_flags import HABIT_FLAGS

GEN = ["generate", "--model", "tiny", "--prompt", "x"]


def _kwargs(argv, capsys):
    kw = engine_kwargs_from_args(build_parser().parse_args(argv))
    return kw, capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_harmless_habits_are_accepted_with_a_note_and_change_nothing(command, capsys):
    base = [command, "--model", "tiny"]
    plain, _ = _kwargs(base, capsys)
    habits = ["--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats",
              "-pp", "1", "--disable-custom-all-reduce", "--tokenizer-mode", "auto"]
    kw, err = _kwargs(base + habits, capsys)
    assert kw == plain
    assert err.count("note: ") == 7 and "--trust-remote-code changes nothing" in err


def test_vllm_parallel_flags_are_engine_settings(capsys):
    """-tp / --tensor-parallel-size and --enable-expert-parallel are kdaserve settings of vLLM's
    meaning, not habit notes; -tp 1 is the default engine."""
    kw, err = _kwargs(GEN + ["-tp", "2"], capsys)
    assert kw["tensor_parallel_size"] == 2 and not err
    kw, _ = _kwargs(GEN + ["--tensor-parallel-size", "1"], capsys)
    assert kw["tensor_parallel_size"] == 1
    kw, _ = _kwargs(GEN + ["-tp", "4", "--enable-expert-parallel"], capsys)
    assert kw["enable_expert_parallel"] is True


@pytest.mark.parametrize("argv, why", [
    (["-pp", "2"], "--pipeline-parallel-size 2: kdaserve's engine splits a model over one host's GPUs by tensor "
                   "parallelism (--tensor-parallel-size N); past one host, or for pipeline stages, run vLLM"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: kdaserve cannot turn chunked prefill off"),
    (["--download-dir", "/x"], "--download-dir /x: kdaserve downloads nothing"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: kdaserve has one tokenizer path"),
])
def test_what_cannot_apply_is_refused_saying_why_and_what_to_use(argv, why, capsys):
    with pytest.raises(ValueError) as err:
        _kwargs(GEN + argv, capsys)
    assert str(err.value).startswith(why), str(err.value)


def test_generate_prints_the_refusal_without_a_traceback(capsys):
    from kdaserve.cli import main

    assert main(GEN + ["--pipeline-parallel-size", "4"]) == 2
    assert "kdaserve generate: --pipeline-parallel-size 4: kdaserve's engine splits a model" in capsys.readouterr().err


def test_every_habit_flag_says_something():
    for flag in HABIT_FLAGS:
        assert (flag.note or not flag.harmless) and (flag.refusal or flag.harmless == (True,)), flag.names
