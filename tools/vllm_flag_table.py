"""docs/vllm-flags.md's table, flag by flag: every `vllm serve` flag (kdaserve/engine/vllm_serve_flags.txt)
with what `kdaserve serve` answers to it: the same flag, accepted with a note, refused with a reason
of its own, or refused as a vLLM flag kdaserve has no setting for. Prints markdown.

    python -m tools.vllm_flag_table
"""

from __future__ import annotations

from kdaserve.cli import build_parser
from kdaserve.engine.vllm_flags import HABIT_FLAGS, vllm_serve_flags


def answers() -> dict[str, str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    serve = sub.choices["serve"]
    ours = {o for a in serve._actions for o in a.option_strings}
    habits = {name: flag for flag in HABIT_FLAGS for name in flag.names}
    out = {}
    for flag in sorted(vllm_serve_flags()):
        negated = habits.get("--" + flag[5:]) if flag.startswith("--no-") else None
        habit = habits.get(flag) or (negated if negated is not None and negated.negatable else None)
        if habit is not None:
            negative = flag not in habits
            if habit.harmless and not negative:
                values = "" if habit.value is None else f" {' / '.join(map(str, habit.harmless))}"
                refusal = f"; other values refused: {habit.refusal}" if habit.value is not None and habit.refusal else ""
                out[flag] = f"accepted{values} with a note: {habit.note}{refusal}"
            else:
                out[flag] = f"refused: {habit.refusal}"
        elif flag in ours:
            out[flag] = "the same flag"
        else:
            out[flag] = "refused: no kdaserve setting (the message names the flag and points here)"
    return out


def main() -> None:
    rows = answers()
    print("| `vllm serve` flag | `kdaserve serve` |")
    print("|---|---|")
    for flag, answer in rows.items():
        print(f"| `{flag}` | {answer} |")


if __name__ == "__main__":
    main()
