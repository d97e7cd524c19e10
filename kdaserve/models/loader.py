"""Building a model from a built-in name or a local checkpoint directory (`config.json`,
`*.safetensors`, `tokenizer.json`), and saving one in that format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kdaserve.backends.kda_backends import KDABackendChoice
from kdaserve.models.builtin import BUILTIN_CONFIGS, builtin_config
from kdaserve.models.config import HybridConfig
from kdaserve.models.hybrid import HybridForCausalLM
from kdaserve.models.random_weights import random_checkpoint
from kdaserve.models.tokenizer import ByteTokenizer, HFTokenizer


@dataclass
class LoadedModel:
    model: HybridForCausalLM
    tokenizer: ByteTokenizer | HFTokenizer
    config: HybridConfig
    name: str


def iterate_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_model(
    model: str, *, dtype: torch.dtype, device, kda: KDABackendChoice | None = None, seed: int = 0,
) -> LoadedModel:
    """`model` is a built-in name (random weights from `seed`) or a checkpoint directory."""
    if model in BUILTIN_CONFIGS:
        config = builtin_config(model)
        net = HybridForCausalLM(config, kda=kda, dtype=dtype, device=device)
        net.load_weights(random_checkpoint(config, seed, dtype=dtype, device=device).items())
        return LoadedModel(net, ByteTokenizer(), config, model)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither a built-in ({sorted(BUILTIN_CONFIGS)}) nor a directory with a config.json"
        )
    config = HybridConfig.from_json(path / "config.json")
    net = HybridForCausalLM(config, kda=kda, dtype=dtype, device=device)
    net.load_weights(iterate_safetensors(path))
    tokenizer = HFTokenizer(path, config.eos_token_id) if (path / "tokenizer.json").is_file() else ByteTokenizer()
    return LoadedModel(net, tokenizer, config, path.name or str(path))


def save_checkpoint(
    path: str | Path, config: HybridConfig, tensors: dict[str, torch.Tensor], tokenizer=None,
) -> None:
    """Write a checkpoint directory the loader reads back: config.json, model.safetensors and,
    for the byte tokenizer, an equivalent tokenizer.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save(path / "config.json")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / "model.safetensors"))
    if isinstance(tokenizer, ByteTokenizer):
        (path / "tokenizer.json").write_text(tokenizer.to_tokenizers_json())
        eos = ByteTokenizer.SPECIALS[0]
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}) + "\n")
