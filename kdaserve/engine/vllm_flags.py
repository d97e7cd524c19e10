"""vLLM flags that users type by habit and that kdaserve has no setting for: each is accepted with
a one-line note where it cannot change anything here, or refused with why and what to use instead,
never a bare "unrecognized arguments" (docs/vllm-flags.md keeps the comparison flag by flag).
Flags with a kdaserve setting of the same meaning are EngineConfig's own (engine/config.py)."""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

ONE_GPU = ("kdaserve's engine splits a model over one host's GPUs by tensor parallelism (--tensor-parallel-size N); "
           "past one host, or for pipeline stages, run vLLM with kdaserve's plugin (pip install -e integrations/vllm; "
           "docs/vllm-plugin.md)")


@dataclass(frozen=True)
class HabitFlag:
    """`names` as vLLM spells them. `value`: None for a switch, else the argparse type. `harmless`:
    the values that change nothing here (a switch: True), each accepted with `note`; any other
    value is refused with `refusal`."""

    names: tuple[str, ...]
    note: str
    refusal: str = ""
    value: type | None = None
    harmless: tuple = (True,)
    negatable: bool = False   # vLLM's --x / --no-x pair

    @property
    def dest(self) -> str:
        return "vllm_habit_" + self.names[0].removeprefix("--").replace("-", "_")


HABIT_FLAGS = (
    HabitFlag(("--trust-remote-code",), "kdaserve never runs a checkpoint's own code (its model families are built "
              "in), so --trust-remote-code changes nothing"),
    HabitFlag(("--enable-chunked-prefill",), "kdaserve always chunks long prefills (--max-num-batched-tokens bounds a "
              "step), so --enable-chunked-prefill changes nothing",
              "kdaserve cannot turn chunked prefill off: a prompt longer than --max-num-batched-tokens always runs in "
              "chunks; raise --max-num-batched-tokens for fewer chunks", negatable=True),
    HabitFlag(("--disable-log-requests",), "kdaserve's server does not log requests, so --disable-log-requests "
              "changes nothing"),
    HabitFlag(("--disable-log-stats",), "kdaserve logs no periodic statistics (/metrics serves them), so "
              "--disable-log-stats changes nothing"),
    HabitFlag(("--pipeline-parallel-size", "-pp"), "pipeline parallel size 1 is kdaserve's engine (one stage)",
              ONE_GPU, value=int, harmless=(1,)),
    HabitFlag(("--data-parallel-size", "-dp"), "data parallel size 1 is one engine",
              "kdaserve runs one engine per server: for data parallelism start one `kdaserve serve` per GPU "
              "(CUDA_VISIBLE_DEVICES) behind a load balancer, or use vLLM with kdaserve's plugin",
              value=int, harmless=(1,)),
    HabitFlag(("--disable-custom-all-reduce",), "kdaserve's all-reduce is torch.distributed's (NCCL), never a "
              "custom one, so --disable-custom-all-reduce changes nothing"),
    HabitFlag(("--download-dir",), "", "kdaserve downloads nothing: give --model a local checkpoint directory (or a "
              "released name with --load-format dummy for random weights at its shape)", value=str, harmless=()),
    HabitFlag(("--revision",), "", "kdaserve downloads nothing, so it has no revision to pick: check the revision "
              "out into a local directory and give --model that directory", value=str, harmless=()),
    HabitFlag(("--tokenizer-mode",), "--tokenizer-mode auto is what kdaserve does (tokenizer.json or the "
              "checkpoint's tiktoken vocabulary)", "kdaserve has one tokenizer path per checkpoint (tokenizer.json "
              "or tiktoken.model): only --tokenizer-mode auto", value=str, harmless=("auto",)),
)


def add_vllm_habit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM flags without a kdaserve setting (each says what it does here)")
    for flag in HABIT_FLAGS:
        helptext = flag.note or flag.refusal
        if flag.value is not None:
            group.add_argument(*flag.names, dest=flag.dest, type=flag.value, default=None, help=helptext)
        elif flag.negatable:
            group.add_argument(*flag.names, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=helptext)
        else:
            group.add_argument(*flag.names, dest=flag.dest, action="store_true", default=None, help=helptext)


def check_vllm_habit_flags(args: argparse.Namespace, out=None) -> None:
    """Print a note (stderr) for each habit flag given that changes nothing; raise ValueError for
    the first that asks for what kdaserve cannot do."""
    out = out or sys.stderr
    for flag in HABIT_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if value in flag.harmless:
            print(f"note: {flag.note}", file=out)
        else:
            given = flag.names[0] if value is True else (f"--no-{flag.names[0][2:]}" if value is False
                                                          else f"{flag.names[0]} {value}")
            raise ValueError(f"{given}: {flag.refusal}")


@functools.cache
def vllm_serve_flags() -> frozenset[str]:
    """Every flag of `vllm serve` (vllm_serve_flags.txt, from vLLM's own parser)."""
    text = (Path(__file__).with_name("vllm_serve_flags.txt")).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.startswith("--"))


def unknown_vllm_flags(unknown: list[str]) -> list[str]:
    """The vLLM flags among arguments argparse did not recognize (`--flag` or `--flag=value`)."""
    return [a.split("=", 1)[0] for a in unknown if a.split("=", 1)[0] in vllm_serve_flags()]


def no_setting_message(command: str, flags: list[str]) -> str:
    return (f"kdaserve {command}: vLLM's {', '.join(flags)} {'has' if len(flags) == 1 else 'have'} no kdaserve setting: "
            f"kdaserve does not do what {'it asks' if len(flags) == 1 else 'they ask'} (docs/vllm-flags.md lists "
            f"vLLM's flags and what kdaserve answers to each; `kdaserve {command} --help` what it takes). "
            f"Leave {'it' if len(flags) == 1 else 'them'} out, or run vLLM with kdaserve's plugin "
            f"(docs/vllm-plugin.md) for vLLM's features")
