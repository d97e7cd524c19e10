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
              "--tensor-parallel-size", "1", "-pp", "1", "--disable-custom-all-reduce", "--tokenizer-mode", "auto"]
    kw, err = _kwargs(base + habits, capsys)
    assert kw == plain
    assert err.count("note: ") == 8 and "--trust-remote-code changes nothing" in err


@pytest.mark.parametrize("argv, why", [
    (["-tp", "2"], "--tensor-parallel-size 2: kdaserve's engine runs one GPU today; to shard a model over several, "
                   "run vLLM with kdaserve's plugin"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: kdaserve cannot turn chunked prefill off"),
    (["--enable-expert-parallel"], "--enable-expert-parallel: kdaserve's engine runs one GPU"),
    (["--download-dir", "/x"], "--download-dir /x: kdaserve downloads nothing"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: kdaserve has one tokenizer path"),
])
def test_what_cannot_apply_is_refused_saying_why_and_what_to_use(argv, why, capsys):
    with pytest.raises(ValueError) as err:
        _kwargs(GEN + argv, capsys)
    assert str(err.value).startswith(why), str(err.value)


def test_generate_prints_the_refusal_without_a_traceback(capsys):
    from kdaserve.cli import main

    assert main(GEN + ["--tensor-parallel-size", "4"]) == 2
    assert "kdaserve generate: --tensor-parallel-size 4: kdaserve's engine runs one GPU" in capsys.readouterr().err


def test_every_habit_flag_says_something():
    for flag in HABIT_FLAGS:
        assert (flag.note or not flag.harmless) and (flag.refusal or flag.harmless == (True,)), flag.names
