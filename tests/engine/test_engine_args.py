"""One source of engine flags: generate, serve and the benchmarks parse the same flags into the
same EngineConfig, with vLLM's names where vLLM has the setting."""

import argparse
import dataclasses

import pytest
import torch

from kdaserve.cli import build_parser
from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args
from kdaserve.engine.config import EngineConfig


def _engine_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """flag -> dest of the parser's engine group."""
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {a.option_strings[0]: a.dest for a in group._group_actions}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_engine_setting_has_one_flag():
    flags = _engine_flags(add_engine_args(argparse.ArgumentParser()))
    assert sorted(flags.values()) == sorted(f.name for f in dataclasses.fields(EngineConfig))


def test_generate_and_serve_declare_the_same_engine_flags():
    assert _engine_flags(_subparser("generate")) == _engine_flags(_subparser("serve"))


@pytest.mark.parametrize("flag", ["--gpu-memory-utilization", "--block-size", "--seed", "--max-num-seqs",
                                  "--max-model-len", "--max-num-batched-tokens", "--enforce-eager", "--dtype",
                                  "--num-gpu-blocks-override", "--mamba-ssm-cache-dtype",
                                  "--max-cudagraph-capture-size", "--max-logprobs"])
def test_vllm_names(flag):
    assert flag in _engine_flags(_subparser("serve"))


def test_flags_reach_the_engine_config():
    args = _subparser("generate").parse_args(
        ["--seed", "7", "--block-size", "32", "--gpu-memory-utilization", "0.5", "--mamba-ssm-cache-dtype", "bfloat16",
         "--num-gpu-blocks-override", "12", "--kda-conv-layout", "DS", "--no-warmup", "--enforce-eager", "--dtype", "float32"])
    cfg = EngineConfig(**engine_kwargs_from_args(args))
    assert (cfg.seed, cfg.block_size, cfg.gpu_memory_utilization, cfg.num_kv_blocks) == (7, 32, 0.5, 12)
    assert cfg.state_dtype == torch.bfloat16 and cfg.conv_layout == "DS" and cfg.dtype == torch.float32
    assert cfg.warmup is False and cfg.enforce_eager is True


def test_defaults_equal_the_engine_config_defaults():
    args = add_engine_args(argparse.ArgumentParser()).parse_args([])
    assert EngineConfig(**engine_kwargs_from_args(args)) == EngineConfig()


def test_a_command_may_override_a_default():
    args = add_engine_args(argparse.ArgumentParser(), model="bench", max_num_seqs=256).parse_args([])
    assert (args.model, args.max_num_seqs) == ("bench", 256)


def test_bad_values_are_refused_by_name():
    parser = add_engine_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--kda-conv-layout", "XY"])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(**engine_kwargs_from_args(parser.parse_args(["--gpu-memory-utilization", "1.5"])))
