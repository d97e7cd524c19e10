"""Engine settings given as JSON objects on the command line (vLLM's --speculative-config,
--limit-mm-per-prompt): one parse, one error form."""

from __future__ import annotations

import json


def json_object(value, setting: str, example: str) -> dict:
    """`value` as a dict: a dict passes through, a string is parsed as JSON. ValueError naming the
    setting, what was wrong and an `example` of what is accepted."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid {setting}: not JSON ({e.msg} at character {e.pos}); expected an object like "
                             f"{example}") from None
    if not isinstance(value, dict):
        raise ValueError(f"invalid {setting}: got {type(value).__name__}; expected a JSON object like {example}")
    return value
