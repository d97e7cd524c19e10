"""`--generation-config`: a checkpoint's sampling defaults (generation_config.json), as vLLM reads
them: `auto` (the default) takes the model directory's file when there is one, `vllm` ignores it,
a folder path takes that folder's. A request's own values win; what the file sets replaces only
the server's defaults (temperature 1.0, top-p 1, no top-k, min-p 0, repetition penalty 1, and the
budget of new tokens where the request gives none)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("kdaserve.server")

# generation_config.json key -> the sampling field it sets the default of
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(setting: str, model: str) -> dict:
    """The defaults `setting` (auto, vllm or a folder) gives for `model` (a name or a directory).
    Raises ValueError for a folder without the file, or values a request could not carry."""
    if setting == "vllm":
        return {}
    folder = Path(model) if setting == "auto" else Path(setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}       # a built-in model or a released name without files: nothing to read
        raise ValueError(f"--generation-config {setting}: no generation_config.json in that folder; expected a "
                         f"folder holding one, 'auto' (the model's) or 'vllm' (none)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    defaults = {ours: cfg[theirs] for theirs, ours in KEYS.items() if cfg.get(theirs) is not None}
    _check(defaults, path)
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s", path, defaults)
    return defaults


def _check(defaults: dict, path: Path) -> None:
    from kdaserve.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**{k: v for k, v in defaults.items() if k != "max_tokens"},
                       max_tokens=defaults.get("max_tokens", 16))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} holds sampling defaults no request could use: {exc}") from None
