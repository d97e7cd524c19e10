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

What stays 4-bit (`FourBitExperts`), in ops/fp4/weights.py's form: the routed experts of every MoE
layer whose experts the checkpoint quantizes all with one scheme, decoded inside the fused MoE
kernels (a quarter of bf16's bytes: most of a MoE model's), and every dense or shared-expert MLP
whose gate, up and down projections share one, run by the 4-bit linear GEMM. Any other 4-bit
layer (attention projections where a checkpoint has them, a layer quantized only in part) is
dequantized once at load into the model's dtype by the definitions in ops/fp4/reference.py, and so
is everything with `KDASERVE_FP4_WEIGHTS=dequantize` (the escape hatch, and the A/B baseline). Either way a
checkpoint gives its dequantized twin's results: bit for bit on the reference paths."""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kdaserve.ops.fp4.reference import (
    MX_GROUP,
    NV_GROUP,
    check_mxfp4_scales,
    check_nvfp4_scales,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from kdaserve.ops.fp4.weights import SCHEME_GROUP

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
    refused, with what the checkpoint is, when it is not one (kdaserve quantizes a checkpoint to 4
    bits nowhere). With random weights (`dummy`) it asks for 4-bit experts at the real shape."""
    want = FOUR_BIT_QUANTIZATIONS[quantization]
    have = quantization_config(config_extra).get("quant_method")
    if dummy:   # random weights: 4-bit experts in the named format (dummy_quantization_config)
        return
    if have != want:
        raise ValueError(f"--quantization {quantization} needs a {want} checkpoint, but {name}'s quantization_config has "
                         f"quant_method {have!r}; leave --quantization unset to load the checkpoint as it is (a 4-bit "
                         f"checkpoint is recognised from its config)")


def dummy_quantization_config(quantization: str) -> dict:
    """The quantization_config random weights take for `--quantization mxfp4 | quark |
    compressed-tensors` (speed and capacity runs at the real shape): the routed experts in MXFP4
    (Quark) or NVFP4 (compressed-tensors), as the released 4-bit checkpoints have them; their random
    weights are quantized at load by the format's rules."""
    if FOUR_BIT_QUANTIZATIONS[quantization] == "quark":
        weight = {"dtype": "fp4", "qscheme": "per_group", "group_size": MX_GROUP, "scale_format": "e8m0"}
        return {"quant_method": "quark", "layer_quant_config": {"*.experts.*": {"weight": weight}}, "exclude": []}
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NV_GROUP}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"experts": {"targets": ["re:.*\\.experts\\.\\d+\\..*"], "weights": weights}}}


FP4_POLICY_ENV = "KDASERVE_FP4_WEIGHTS"


def fp4_policy() -> str:
    policy = os.environ.get(FP4_POLICY_ENV, "keep")
    if policy not in ("keep", "dequantize"):
        raise ValueError(f"{FP4_POLICY_ENV}={policy!r}: expected keep (4-bit experts in the fused kernels) or dequantize")
    return policy


@dataclass(frozen=True)
class FourBitExperts:
    """What stays 4-bit: the routed experts of MoE layers (layer index -> "mxfp4" / "nvfp4") and the
    dense or shared-expert MLPs ((layer index, shared?) -> scheme). Experts stay 4-bit when the
    checkpoint quantizes every one of their projections with one scheme, an MLP when its gate, up
    and down projections share one; anything quantized only in part is dequantized (a log line)."""

    layers: dict[int, str]
    layer: re.Pattern      # a released layer tensor name -> (index, rest): the family's
    experts: re.Pattern    # `rest` of a routed expert's weight
    mlps: dict[tuple[int, bool], str] = field(default_factory=dict)
    mlp: re.Pattern = re.compile("(?!)")   # `rest` of a dense or shared-expert MLP's weight

    def scheme(self, i: int) -> str | None:
        return self.layers.get(i)

    def mlp_scheme(self, i: int, shared: bool) -> str | None:
        """Layer i's dense MLP (shared=False) or shared experts' scheme, None in full precision."""
        return self.mlps.get((i, shared))

    def keeps(self, module: str) -> bool:
        """Whether released module `<m>` (of `<m>.weight`) is kept in 4 bits."""
        m = self.layer.fullmatch(module + ".weight")
        if not m:
            return False
        i, rest = int(m[1]), m[2]
        if self.experts.fullmatch(rest):
            return i in self.layers
        return self.mlp.fullmatch(rest) is not None and (i, "shared_experts" in rest) in self.mlps

    def scheme_of(self, module: str) -> str:
        """The scheme of a kept module."""
        m = self.layer.fullmatch(module + ".weight")
        i, rest = int(m[1]), m[2]
        return self.layers[i] if self.experts.fullmatch(rest) else self.mlps[i, "shared_experts" in rest]

    def with_pieces(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Released `shapes` with each kept weight [out, in] as its 4-bit tensors: packed [out, in/2],
        weight_scale [out, in/group] and, for NVFP4, weight_global_scale [1]."""
        if not (self.layers or self.mlps):
            return shapes
        out = {}
        for name, shape in shapes.items():
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and self.keeps(module)):
                out[name] = shape
                continue
            scheme = self.scheme_of(module)
            rows, cols = shape
            out[name] = (rows, cols // 2)
            out[module + ".weight_scale"] = (rows, cols // SCHEME_GROUP[scheme])
            if scheme == "nvfp4":
                out[module + ".weight_global_scale"] = (1,)
        return out


NO_FOUR_BIT_EXPERTS = FourBitExperts({}, re.compile("(?!)"), re.compile("(?!)"))


def four_bit_experts(config_extra: dict, shapes: Callable[[], dict[str, tuple[int, ...]]], layer: re.Pattern,
                     experts: re.Pattern, mlp: re.Pattern) -> FourBitExperts:
    """What a model keeps in 4 bits (see FourBitExperts), from the checkpoint's config and the
    family's released `shapes()` (built only for a 4-bit config); nothing without a 4-bit config or
    under KDASERVE_FP4_WEIGHTS=dequantize."""
    layout = fp4_layout(config_extra)
    if layout is None or fp4_policy() == "dequantize":
        return NO_FOUR_BIT_EXPERTS
    per_experts: dict[int, set[str | None]] = {}
    per_mlp: dict[tuple[int, bool], set[str | None]] = {}
    for name in shapes():
        m = layer.fullmatch(name)
        if not m:
            continue
        if experts.fullmatch(m[2]):
            per_experts.setdefault(int(m[1]), set()).add(layout.scheme_of(name.removesuffix(".weight")))
        elif mlp.fullmatch(m[2]):
            per_mlp.setdefault((int(m[1]), "shared_experts" in m[2]), set()).add(layout.scheme_of(name.removesuffix(".weight")))

    def whole(groups: dict) -> dict:
        partial = sorted(k for k, schemes in groups.items() if len(schemes) > 1)
        if partial:
            log.warning("4-bit checkpoint: %s quantized only in part (or with several schemes): dequantized at load",
                        partial)
        return {k: next(iter(s)) for k, s in groups.items() if len(s) == 1 and None not in s}

    return FourBitExperts(whole(per_experts), layer, experts, whole(per_mlp), mlp)


def dequantized_fp4_weights(weights: Iterable[tuple[str, torch.Tensor]], layout: Fp4Layout, dtype: torch.dtype,
                            keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every 4-bit layer's pieces turned into its `<m>.weight` in
    `dtype` (pieces may arrive in any order, from any shard); other tensors pass through. Modules
    `keep` names stay 4-bit in ops/fp4/weights.py's form instead: `<m>.weight` (packed codes),
    `<m>.weight_scale` (uint8) and for NVFP4 `<m>.weight_global_scale`, each as it arrives (one
    arriving in full precision is quantized here by its scheme's rules). A piece without the rest
    of its layer, or a 4-bit layer stored unquantized, is an error naming it."""
    keep = keep or (lambda module: False)
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    schemes: dict[str, str | None] = {}
    said: set[str] = set()

    def scheme(module: str) -> str | None:
        if module not in schemes:
            schemes[module] = layout.scheme_of(module)
        return schemes[module]

    for name, t in weights:
        module, _, piece = name.rpartition(".")
        # Only what a 4-bit layer stores asks for the layer's scheme: packed uint8 codes, their
        # scales and global scales. Everything else (norms, embeddings, a float weight) passes.
        packed = piece in ("weight_packed", *_UNUSED, "weight_global_scale") or (piece == "weight" and t.dtype == torch.uint8)
        if piece == "weight" and not packed and keep(module) and scheme(module) is not None:
            if "quantized" not in said:   # random weights always; a checkpoint only against its own config
                said.add("quantized")
                log.info("%s arrived in full precision though the config quantizes it (%s): quantized at load, as are "
                         "others like it", name, scheme(module))
            yield from _quantized_pieces(module, t, scheme(module))
            continue
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
        if keep(module):   # in the kept form, as it arrives: load_released checks that none is missing
            _check_kept_piece(name, piece, t, s)
            yield module + "." + ("weight" if piece == "weight_packed" else piece), _kept_form(t)
            continue
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


def _quantized_pieces(module: str, weight: torch.Tensor, scheme: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A kept 4-bit module that arrived in full precision (random weights), quantized by its scheme."""
    if scheme == "mxfp4":
        packed, scale = quantize_mxfp4(weight)
        yield module + ".weight", packed
        yield module + ".weight_scale", scale
    else:
        packed, scale, g = quantize_nvfp4(weight)
        yield module + ".weight", packed
        yield module + ".weight_scale", _kept_form(scale)
        yield module + ".weight_global_scale", g


def _check_kept_piece(name: str, piece: str, t: torch.Tensor, scheme: str) -> None:
    """What dequantizing would refuse (ops/fp4/reference.py's checks), refused for a piece kept as it is."""
    if piece == "weight_scale" and scheme == "mxfp4":
        check_mxfp4_scales(t, name)
    elif piece == "weight_scale":
        check_nvfp4_scales(t, None, name)
    elif piece == "weight_global_scale":
        if t.numel() != 1:
            raise ValueError(f"{name}: the NVFP4 global scale must be one value, got {list(t.shape)}")
        check_nvfp4_scales(None, t, name)


def _kept_form(t: torch.Tensor) -> torch.Tensor:
    """NVFP4's e4m3 scales as their bits (uint8, ops/fp4/weights.py): not taken for FP8 weights downstream."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
