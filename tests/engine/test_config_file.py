"""`--config FILE` (vLLM's): a YAML file's flags, overridden by the ones typed."""

import json

import pytest

from kdaserve.commands.config_file import expand_config_file


def test_a_yaml_file_becomes_flags_that_typed_ones_override(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: tiny\nmax_num_seqs: 8\nenforce-eager: true\nenable-docs: false\napi-key: [a, b]\n"
                   "speculative-config: {num_speculative_tokens: 2}\n")
    argv = expand_config_file(["serve", "--config", str(cfg), "--max-num-seqs", "4"])
    assert argv[:1] == ["serve"] and argv[-2:] == ["--max-num-seqs", "4"]
    assert argv[1:-2] == ["--model", "tiny", "--max-num-seqs", "8", "--enforce-eager", "--api-key", "a", "--api-key", "b",
                          "--speculative-config", json.dumps({"num_speculative_tokens": 2})]
    from kdaserve.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.max_num_seqs == 4 and args.model == "tiny" and args.enforce_eager and args.api_key == ["a", "b"]
    assert expand_config_file(["serve", f"--config={cfg}"])[1:3] == ["--model", "tiny"]


@pytest.mark.parametrize("text, message", [("- a\n- b\n", "expected a mapping"), ("a: [\n", "not valid YAML")])
def test_bad_config_files_say_what_is_wrong(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit, match=message):
        expand_config_file(["serve", "--config", str(cfg)])
    with pytest.raises(SystemExit, match="no such file"):
        expand_config_file(["serve", "--config", str(tmp_path / "missing.yaml")])
