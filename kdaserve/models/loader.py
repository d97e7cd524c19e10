"""Building a model from a built-in name, a released name or a local checkpoint directory
(`config.json`, `*.safetensors` (sharded or not), the tokenizer), and saving one in that format.

The family comes from `config.json`'s `model_type` (families.py). `load_format="dummy"` fills the
model with random weights at its real shape through the same loader as a checkpoint (names,
shapes and completeness are checked the same way), one tensor at a time."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kdaserve.backends.kda_backends import KDABackendChoice, KDABackends
from kdaserve.layers.distributed import tp_size
from kdaserve.models.builtin import BUILTIN_CONFIGS, FAMILY_BUILTIN_CONFIGS, SHIPPED_CHECKPOINTS, builtin_config, released_config
from kdaserve.models.capacity import check_weights_fit
from kdaserve.models.causal_lm import kda_backends_for
from kdaserve.models.checkpoint_tensor import CheckpointTensor
from kdaserve.models.families import family_of, family_of_config
from kdaserve.models.fp4 import FOUR_BIT_QUANTIZATIONS, check_four_bit_checkpoint, dummy_quantization_config
from kdaserve.models.hybrid_config import HybridConfig
from kdaserve.models.tokenizer import ByteTokenizer, HFTokenizer, load_checkpoint_tokenizer

log = logging.getLogger("kdaserve.models")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    config: object
    name: str
    kda_backends: KDABackends | None   # the pair every KDA layer of `model` shares (None: no KDA layers)


def iterate_safetensors(path: str | Path, *, lazy: bool = False,
                        on_read=None) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """Every tensor of a checkpoint directory, file by file. `lazy`: CheckpointTensors, read when
    used, only the slice a tensor-parallel rank narrows them to (each keeps its file open until
    it is gone); `on_read(name, nbytes)`: told of each read (tests count a rank's bytes)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        if lazy:
            st = safe_open(str(f), framework="pt", device="cpu")
            for name in st.keys():
                yield name, CheckpointTensor(st, name, on_read)
            continue
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _tokenizer_from(directory: str, config):
    path = Path(directory)
    if not ((path / "tokenizer.json").is_file() or (path / "tiktoken.model").is_file()):
        raise ValueError(f"--tokenizer {directory!r}: expected a directory holding tokenizer.json or tiktoken.model")
    tok = load_checkpoint_tokenizer(path, config.eos_token_id)
    if tok.vocab_size > config.vocab_size:
        raise ValueError(f"--tokenizer {directory!r} has {tok.vocab_size} tokens but the model's vocabulary has "
                         f"{config.vocab_size}: its ids would index past the embedding; expected at most {config.vocab_size}")
    return tok


def load_model(
    model: str, *, dtype: torch.dtype, device, kda: KDABackendChoice | None = None, seed: int = 0,
    load_format: str = "auto", mla_backend: str = "auto", moe_backend: str = "auto", tokenizer_dir: str | None = None,
    mtp: bool = False, quantization: str | None = None, images: bool = True,
) -> LoadedModel:
    """`model`: a built-in name (random weights from `seed`), a released name (its architecture;
    weights only with load_format="dummy") or a checkpoint directory. `tokenizer_dir`: a directory
    whose tokenizer replaces the model's (vLLM's --tokenizer; a released name with dummy weights
    then tokenizes as the real model does). `mtp`: also the model's multi-token-prediction layer
    (the drafter of speculative method "mtp"). `quantization`: "fp8" for block-scaled FP8 weights
    (families with an FP8 path), None for the checkpoint's own format; "mxfp4", "quark" and
    "compressed-tensors" name a 4-bit checkpoint's own format (models/fp4.py), checked against it.
    `images`: the vision tower where the family and checkpoint have one (False: text only)."""
    config, tokenizer, name, dummy = resolve_model(model, load_format, tokenizer_dir)
    family = family_of_config(config)
    if quantization in FOUR_BIT_QUANTIZATIONS:   # the checkpoint's own 4-bit format, named as vLLM names it
        check_four_bit_checkpoint(quantization, config.extra, name, dummy)
        if dummy:   # random weights with 4-bit experts in the named format, quantized at load
            config.extra = {**config.extra, "quantization_config": dummy_quantization_config(quantization)}
        quantization = None
    if quantization is not None and family.fp8_tensors is None:
        raise ValueError(f"--quantization {quantization}: {family.name} ({name}) has no FP8 path yet; GLM-5.3-Flash "
                         f"(glm5_next) and Kimi-Linear (kimi_linear) have one. Leave --quantization unset to serve it "
                         f"in its dtype")
    if mtp and not family.has_mtp:
        raise ValueError(f"speculative method 'mtp' needs a model with a multi-token-prediction layer; {family.name} "
                         f"({name}) has none: use the 'ngram' method")
    shapes = None if family.shapes is None else family.shapes(config, True) if mtp else family.shapes(config)
    if shapes is not None and images and family.vision_shapes is not None:   # the tower, whole on every rank
        shapes = {**shapes, **family.vision_shapes(config)}
    fp8 = family.fp8_tensors(config, device, quantization) if family.fp8_tensors is not None else None
    fp4 = family.fp4_tensors(config, shapes, device, quantization) if family.fp4_tensors is not None else None
    check_weights_fit(name, shapes, dtype, device, fp8, tp_size(), fp4)
    kda_backends = kda_backends_for(config, kda or KDABackendChoice(), dtype, device)   # once, for every KDA layer
    net = family.build(config, kda_backends=kda_backends, mla_backend=mla_backend, moe_backend=moe_backend, dtype=dtype,
                       device=device, mtp=mtp, quantization=quantization, images=images)
    weights = (family.random_weights(config, seed, dtype=dtype, device=device, mtp=mtp) if dummy
               else iterate_safetensors(SHIPPED_CHECKPOINTS.get(model, model), lazy=tp_size() > 1))
    net.load_weights(weights)
    if getattr(net, "image_token_id", None) is not None:   # a vision tower: its processing rules (Pillow) beside it
        from kdaserve.models.glm5_next_images import image_rules

        net.image_rules = image_rules(SHIPPED_CHECKPOINTS.get(model, model))
    return LoadedModel(net, tokenizer, config, name, kda_backends)


def resolve_model(model: str, load_format: str = "auto", tokenizer_dir: str | None = None, *, tokenizer: bool = True):
    """What `model` names, without building it: (config, tokenizer, display name, dummy weights?).
    `tokenizer=False`: the config alone (the tokenizer None, nothing of it read)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = Path(SHIPPED_CHECKPOINTS.get(model, model))
    if model in BUILTIN_CONFIGS or model in FAMILY_BUILTIN_CONFIGS:
        config = builtin_config(model)
        # A built-in vision model's byte tokenizer has the image placeholder tokens too.
        tok, name, dummy = ByteTokenizer(image_tokens=getattr(config, "vision", None) is not None), model, True
    elif (path / "config.json").is_file():
        config_dict = json.loads((path / "config.json").read_text())
        config = family_of(config_dict).config_from_dict(config_dict)
        name = model if model in SHIPPED_CHECKPOINTS else path.name or str(path)
        dummy = load_format == "dummy"
        tok = load_checkpoint_tokenizer(path, config.eos_token_id) if tokenizer else None
    elif (config := released_config(model)) is not None:
        if load_format != "dummy":
            raise ValueError(f"{model!r} is a released model whose weights are not on this machine: pass its checkpoint "
                             f"directory as --model, or --load-format dummy for random weights at its real shape")
        tok, name, dummy = ByteTokenizer(), model, True
        log.info("%s: random weights at the released shape (--load-format dummy), byte tokenizer", model)
    else:
        raise ValueError(
            f"model {model!r} is neither a built-in ({sorted(BUILTIN_CONFIGS) + sorted(FAMILY_BUILTIN_CONFIGS)}), a shipped "
            f"checkpoint ({sorted(SHIPPED_CHECKPOINTS)}), a released "
            f"name with a known architecture, nor a directory with a config.json"
        )
    if tokenizer_dir is not None and tokenizer:
        tok = _tokenizer_from(tokenizer_dir, config)
    return config, tok, name, dummy


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


__all__ = ["HFTokenizer", "LoadedModel", "iterate_safetensors", "load_model", "save_checkpoint"]
