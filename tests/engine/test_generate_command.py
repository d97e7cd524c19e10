import argparse

from kdaserve.commands import generate


def _run(argv):
    parser = argparse.ArgumentParser()
    generate.register(parser.add_subparsers())
    args = parser.parse_args(["generate", *argv])
    return args.func(args)


REF = ["--kda-prefill-backend", "reference", "--kda-decode-backend", "reference", "--no-progress", "--max-model-len", "128"]


def test_generate_prints_completions_and_throughput(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("from a file\n\nsecond line\n")
    assert _run(["--model", "tiny", "--prompt", "Hello", "--prompts-file", str(f), "--max-tokens", "5", *REF]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 3 and "'from a file'" in out and "'second line'" in out
    assert "prefill: 27 tokens" in out and "decode:  12 tokens" in out and "tok/s" in out


def test_json_output_is_only_json_lines_and_the_summary_goes_to_stderr(capsys):
    import json

    assert _run(["--model", "tiny", "--prompt", "Hello", "--prompt", "again", "--max-tokens", "3", "--json", *REF]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2 and [json.loads(line)["prompt"] for line in lines] == ["Hello", "again"]
    assert "decode:" in captured.err and "tok/s" in captured.err


def test_version_and_python_dash_m(capsys):
    import subprocess
    import sys

    import pytest

    from kdaserve.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("kdaserve ")
    ran = subprocess.run([sys.executable, "-m", "kdaserve", "--version"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.startswith("kdaserve "), ran.stderr


def test_generate_reports_bad_input_without_a_traceback(capsys):
    assert _run(["--model", "tiny", "--prompt", "x", "--temperature", "-1", *REF]) == 2
    assert "temperature: got -1.0" in capsys.readouterr().err
    assert _run(["--model", "tiny", *REF]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_no_warmup_flag_reaches_the_engine(monkeypatch):
    seen = {}

    class FakeLLM:
        def __init__(self, model, **kw):
            seen.update(kw)
            raise ValueError("stop here")

    import kdaserve.engine

    monkeypatch.setattr(kdaserve.engine, "LLM", FakeLLM)
    _run(["--model", "tiny", "--prompt", "x", *REF])
    assert seen["warmup"] is True
    _run(["--model", "tiny", "--prompt", "x", "--no-warmup", *REF])
    assert seen["warmup"] is False


def test_every_option_of_every_command_says_what_it_does():
    from kdaserve.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    silent = {name: [a.option_strings[0] for a in sub.choices[name]._actions
                     if a.option_strings and not a.help and a.dest != "help"] for name in COMMANDS}
    assert not any(silent.values()), silent
