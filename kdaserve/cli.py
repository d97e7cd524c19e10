"""`kdaserve <command>`: each command lives in kdaserve/commands/<name>.py with
`register(subparsers)` adding its parser (with `set_defaults(func=...)`)."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("info", "demo", "parity", "generate", "serve", "accuracy", "ab")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kdaserve")
    except PackageNotFoundError:   # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdaserve", description="Serve hybrid KDA language models.")
    parser.add_argument("--version", action="version", version=f"kdaserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kdaserve.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kdaserve.commands.config_file import expand_config_file
    from kdaserve.engine.vllm_flags import no_setting_message, unknown_vllm_flags

    argv = expand_config_file(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # a vLLM flag kdaserve has no setting for says so; anything else is argparse's error
        vllm = unknown_vllm_flags(unknown)
        if vllm:
            print(no_setting_message(args.command, vllm), file=sys.stderr)
            return 2
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
