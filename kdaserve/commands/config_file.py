"""`--config FILE` (vLLM's): a YAML mapping of flag names to values, expanded into command-line
flags before parsing, ahead of the ones typed, so a typed flag wins over the file's.

    # serve.yaml
    model: moonshotai/Kimi-Linear-48B-A3B-Instruct
    port: 8000
    max-num-seqs: 128          # dashes or underscores
    enforce-eager: true        # a switch: true adds it, false leaves it out
    api-key: [key1, key2]      # a list repeats the flag
"""

from __future__ import annotations

from pathlib import Path


def expand_config_file(argv: list[str]) -> list[str]:
    """argv with each `--config FILE` / `--config=FILE` replaced by the file's flags, placed
    right after the subcommand (argv[0]) so that flags typed on the command line override them."""
    out, config_args, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise SystemExit("--config needs a YAML file")
                path, i = argv[i + 1], i + 2
            else:
                path, i = arg.split("=", 1)[1], i + 1
            config_args += flags_from_yaml(path)
            continue
        out.append(arg)
        i += 1
    if not config_args:
        return out
    return out[:1] + config_args + out[1:]


def flags_from_yaml(path: str) -> list[str]:
    try:
        import yaml
    except ImportError:
        raise SystemExit("--config reads YAML: pip install pyyaml (or 'kdaserve[serve]')") from None

    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SystemExit(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    args: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            for item in value:
                args += [flag, str(item)]
        elif isinstance(value, dict):   # a JSON-valued flag, such as --speculative-config
            import json

            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args
