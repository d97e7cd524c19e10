"""The engine's command-line flags, derived from EngineConfig's fields: `generate`, `serve` and the
benchmarks declare the same flags with the same meaning. Names are vLLM's where vLLM has the
setting (`--gpu-memory-utilization`, `--block-size`, `--seed` as the engine seed,
`--num-gpu-blocks-override`, `--mamba-ssm-cache-dtype`, `--max-cudagraph-capture-size`, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

import torch

from kdaserve.engine.config import EngineConfig
from kdaserve.engine.vllm_flags import add_vllm_habit_flags, check_vllm_habit_flags


def _flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _scalar_type(f: dataclasses.Field):
    """int / float / str for argparse from the field's annotation (Optional and unions with
    torch types parse as str; EngineConfig converts)."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    for t in (int, float):
        if t in args and not any(a is str for a in args):
            return t
    return str


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Add one flag per engine setting. `defaults` overrides a field's default for this command
    (a benchmark may default to the `bench` model, say)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        meta, flag = f.metadata, _flag_name(f)
        default = defaults.get(f.name, f.default)
        flags = (flag, *meta.get("aliases", ()))
        if meta.get("boolean_optional"):
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=meta["help"])
            continue
        if isinstance(default, bool):
            # A flag that flips the default: --enforce-eager sets True, --no-warmup sets False.
            group.add_argument(*flags, dest=f.name, action="store_false" if default else "store_true",
                               default=default, help=meta["help"])
            continue
        if isinstance(default, torch.dtype):  # parsed like the flag's value: "float32", not torch.float32
            default = str(default).removeprefix("torch.")
        group.add_argument(*flags, dest=f.name, type=_scalar_type(f), default=default,
                           metavar=flag.removeprefix("--").replace("-", "_").upper(),
                           help=meta["help"] + (f" (default: {default})" if default is not None else ""),
                           **meta["argparse"])
    # Read (and removed) before parsing by commands/config_file.py; declared so that --help shows it.
    parser.add_argument("--config", metavar="FILE", help="a YAML file of flags (vLLM's --config): 'max-num-seqs: 128' "
                       "per line; flags typed on the command line win")
    add_vllm_habit_flags(parser)
    return parser


def engine_kwargs_from_args(args: argparse.Namespace, **overrides) -> dict:
    """The EngineConfig keyword arguments the parsed flags name (model included). vLLM flags without
    a kdaserve setting print their note here, or raise ValueError saying why they cannot apply."""
    check_vllm_habit_flags(args)
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    kw.update(overrides)
    return kw


def engine_kwargs_from_flags(model: str, flags: str) -> dict:
    """The EngineConfig keyword arguments of one string of engine flags (`--a="..."` of
    `kdaserve ab` and `kdaserve accuracy`), `model` unless the flags name one. Raises
    argparse.ArgumentError or SystemExit (argparse's) for a bad flag."""
    import shlex

    parser = add_engine_args(argparse.ArgumentParser(prog="engine flags", exit_on_error=False), model=model)
    return engine_kwargs_from_args(parser.parse_args(shlex.split(flags)))
