"""4-bit checkpoints: which layers a checkpoint quantizes, read from its own `quantization_config`
(never assumed), and its tensors turned into the weights the model loads.

- **AMD Quark** (`quant_method: quark`, e.g. amd/GLM-5.3-Flash-Quark-MXFP4): a layer's scheme is
  the first of `layer_quant_config` (its name matched by the pattern: fnmatch with `*`, else the
  name contained in the pattern, as vLLM reads it), `layer_type_quant_config["Linear"]`,
  `global_quant_config`, unless `exclude` names it (exactly, or `re:` + a regular expression
  matched from the start). A scheme whose weight is `fp4`, `per_group`, 32 values, `e8m0` scales is
  MXFP4: `<m>.weight` (uint8 [out, in/2]) and `<m>.weight_scale` (uint8 [out, in/32]).
- **compressed-tensors** (`quant_method: compressed-tensors`, e.g. RedHatAI/GLM-5.3-Flash-NVFP4): the
  first of `config_groups` whose `targets` match the layer (`Linear`: every linear layer; `re:`
  patterns; exact names), unless `ignore` names it; `weights` of 4-bit floats in `tensor_group`s of
  16 with the `nvfp4-pack-quantized` format are NVFP4: `<m>.weight_packed`, `<m>.weight_scale`
  (float8_e4m3fn [out, in/16]) and `<m>.weight_global_scale` (fp32, dividing), and for W4A4
  checkpoints `<m>.input_global_scale`, which W4A16 does not use.

A layer whose scheme is neither (int4, another group size, output quantization, ...) is a startup
error naming the scheme and the layer. Activations stay in the model's dtype (W4A16) whatever the
checkpoint's `input_tensors` / `input_activations` say; a log line says when they asked for more.

For now kdaserve dequantizes 4-bit weights once at load into the model's dtype (the definitions in
ops/fp4/reference.py): such checkpoints load and serve exactly as their dequantized twins, with the
memory of that dtype; keeping the experts in 4 bits inside the fused MoE kernels is still to come."""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kdaserve.ops.fp4.reference import MX_GROUP, NV_GROUP, dequantize_mxfp4, dequantize_nvfp4

log = logging.getLogger(__name__)

METHODS = ("quark", "compressed-tensors")
# The tensors a 4-bit layer `<m>` stores, by scheme; the first one is its weight.
_PIECES = {"mxfp4": ("weight", "weight_scale"),
           "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale")}
_UNUSED = ("input_global_scale",)   # W4A4's activation scale: W4A16 ignores it


def quantization_config(config_extra: dict) -> dict:
    """The checkpoint's quantization_config (top level, or the outer config of a nested one)."""
    return (config_extra.get("quantization_config")
            or (config_extra.get("outer_config") or {}).get("quantization_config") or {})


def _named(name: str, patterns: Iterable[str]) -> bool:
    """`name` is one of `patterns`: exactly, or by `re:` + an expression matched from its start."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name:
            return True
    return False


@dataclass
class Fp4Layout:
    """Which linear layers (by their released module name, `<m>` of `<m>.weight`) a 4-bit checkpoint
    quantizes and how."""

    method: str
    config: dict
    _said: set = field(default_factory=set)

    def scheme_of(self, module: str) -> str | None:
        """"mxfp4", "nvfp4" or None (kept in full precision); an unknown scheme is an error."""
        return self._quark(module) if self.method == "quark" else self._compressed_tensors(module)

    def _quark(self, module: str) -> str | None:
        q = self.config
        if _named(module, q.get("exclude") or []):
            return None
        scheme = None
        for pattern, cfg in (q.get("layer_quant_config") or {}).items():
            if (fnmatch.fnmatch(module, pattern) if "*" in pattern else module in pattern):
                scheme = cfg
                break
        else:
            scheme = (q.get("layer_type_quant_config") or {}).get("Linear", q.get("global_quant_config"))
        weight = (scheme or {}).get("weight")
        if not weight:
            return None
        if (scheme.get("output_tensors") or scheme.get("bias")) or not (
                weight.get("dtype") == "fp4" and weight.get("qscheme") == "per_group"
                and weight.get("group_size") == MX_GROUP and weight.get("scale_format", "e8m0") == "e8m0"):
            raise ValueError(f"{module}: Quark scheme {scheme} is not one kdaserve loads; it loads MXFP4 weights "
                             f"(dtype fp4, qscheme per_group, group_size {MX_GROUP}, scale_format e8m0)")
        self._say_activations(scheme.get("input_tensors"))
        return "mxfp4"

    def _compressed_tensors(self, module: str) -> str | None:
        q = self.config
        if _named(module, q.get("ignore") or []):
            return None
        for group_name, group in (q.get("config_groups") or {}).items():
            targets = group.get("targets") or []
            if "Linear" not in targets and not _named(module, targets):
                continue
            weights = group.get("weights") or {}
            fmt = group.get("format") or q.get("format")
            if not (weights.get("num_bits") == 4 and weights.get("type") == "float"
                    and weights.get("strategy") == "tensor_group" and weights.get("group_size") == NV_GROUP
                    and fmt == "nvfp4-pack-quantized"):
                raise ValueError(f"{module}: compressed-tensors group {group_name!r} ({weights}, format {fmt!r}) is not "
                                 f"one kdaserve loads; it loads nvfp4-pack-quantized weights (4-bit floats in "
                                 f"tensor_group groups of {NV_GROUP})")
            self._say_activations(group.get("input_activations"))
            return "nvfp4"
        return None

    def _say_activations(self, activations) -> None:
        if activations and "activations" not in self._said:
            self._said.add("activations")
            log.info("%s checkpoint quantizes activations too (%s): kdaserve runs its 4-bit weights with activations "
                     "in the model's dtype (W4A16)", self.method, {k: activations.get(k) for k in ("dtype", "type",
                                                                                                    "num_bits", "qscheme")
                                                                                             if k in activations})


def fp4_layout(config_extra: dict) -> Fp4Layout | None:
    """The 4-bit layout of a checkpoint's config, or None when it is not a Quark or
    compressed-tensors checkpoint."""
    q = quantization_config(config_extra)
    method = q.get("quant_method")
    return Fp4Layout(method, q) if method in METHODS else None


# --quantization values that name a 4-bit checkpoint's own format (vLLM's spellings) -> its quant_method.
FOUR_BIT_QUANTIZATIONS = {"mxfp4": "quark", "quark": "quark", "compressed-tensors": "compressed-tensors"}


def check_four_bit_checkpoint(quantization: str, config_extra: dict, name: str, dummy: bool) -> None:
    """--quantization mxfp4 / quark / compressed-tensors asks for the checkpoint's own 4-bit format:
    refused, with what the checkpoint is, when it is not one (kdaserve quantizes to 4 bits nowhere)."""
    want = FOUR_BIT_QUANTIZATIONS[quantization]
    have = quantization_config(config_extra).get("quant_method")
    if dummy:
        raise ValueError(f"--quantization {quantization} with random weights ({name}): kdaserve does not build 4-bit "
                         f"weights yet; use a {want} checkpoint directory, or --quantization fp8")
    if have != want:
        raise ValueError(f"--quantization {quantization} needs a {want} checkpoint, but {name}'s quantization_config has "
                         f"quant_method {have!r}; leave --quantization unset to load the checkpoint as it is (a 4-bit "
                         f"checkpoint is recognised from its config)")


def dequantized_fp4_weights(weights: Iterable[tuple[str, torch.Tensor]], layout: Fp4Layout,
                            dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every 4-bit layer's pieces turned into its `<m>.weight` in
    `dtype` (pieces may arrive in any order, from any shard); other tensors pass through. A piece
    without the rest of its layer, or a 4-bit layer stored unquantized, is an error naming it."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    schemes: dict[str, str | None] = {}

    def scheme(module: str) -> str | None:
        if module not in schemes:
            schemes[module] = layout.scheme_of(module)
        return schemes[module]

    for name, t in weights:
        module, _, piece = name.rpartition(".")
        # Only what a 4-bit layer stores asks for the layer's scheme: packed uint8 codes, their
        # scales and global scales. Everything else (norms, embeddings, a float weight) passes.
        packed = piece in ("weight_packed", *_UNUSED, "weight_global_scale") or (piece == "weight" and t.dtype == torch.uint8)
        if not (packed or piece == "weight_scale"):
            yield name, t
            continue
        s = scheme(module)
        if s is None:
            if packed and piece != "weight_global_scale":
                raise ValueError(f"{name} holds packed 4-bit codes, but the checkpoint's quantization_config does not "
                                 f"quantize {module} (excluded or ignored)")
            yield name, t
            continue
        if piece in _UNUSED:
            continue
        if piece not in _PIECES[s]:
            raise ValueError(f"{name}: {module} is {s.upper()} by the checkpoint's quantization_config, whose tensors are "
                             f"{', '.join(module + '.' + p for p in _PIECES[s])}")
        parts = waiting.setdefault(module, {})
        parts[piece] = t
        if len(parts) == len(_PIECES[s]):
            del waiting[module]
            if s == "mxfp4":
                w = dequantize_mxfp4(parts["weight"], parts["weight_scale"], dtype, name=module)
            else:
                w = dequantize_nvfp4(parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"], dtype,
                                     name=module)
            yield module + ".weight", w
    if waiting:
        lacking = {m: sorted(set(_PIECES[schemes[m]]) - set(p)) for m, p in sorted(waiting.items())[:4]}
        raise ValueError(f"{len(waiting)} 4-bit layers lack tensors of their scheme, e.g. {lacking}")
