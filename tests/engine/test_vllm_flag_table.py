"""Every `vllm serve` flag has an answer in kdaserve (docs/vllm-flags.md, tools/vllm_flag_table.py):
the same flag, a note, or a refusal that names it; the docs' table is the tool's output."""

from pathlib import Path

import pytest

from kdaserve.engine.vllm_flags import vllm_serve_flags
from tools.vllm_flag_table import answers

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md"


def test_the_docs_table_is_the_tools_output():
    text = DOC.read_text().split("python -m tools.vllm_flag_table", 1)[1]   # the generated table follows
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    assert rows == [f"| `{flag}` | {answer} |" for flag, answer in answers().items()]
    assert len(rows) == len(vllm_serve_flags()) > 300


@pytest.mark.parametrize("argv", [["--enable-lora"], ["--max-loras", "4"], ["--kv-transfer-config={}"],
                                  ["--enable-lora", "--no-trust-remote-code"]])
def test_a_vllm_flag_without_a_setting_is_refused_by_name(argv, capsys):
    from kdaserve.cli import main

    assert main(["serve", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert "kdaserve serve: vLLM's --" in err and "no kdaserve setting" in err and "docs/vllm-flags.md" in err
    assert argv[0].split("=")[0] in err


def test_other_unknown_flags_keep_argparse_s_error(capsys):
    from kdaserve.cli import main

    with pytest.raises(SystemExit) as done:
        main(["serve", "tiny", "--no-such-flag"])
    assert done.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
