"""FP8 block-scaled checkpoints (DeepSeek-V3's format, GLM-5.3-Flash's release): a quantized linear
weight `X.weight` [rows, cols] in float8_e4m3fn comes with `X.weight_scale_inv` [ceil(rows / br),
ceil(cols / bc)] in fp32, one factor per br x bc block (`quantization_config.weight_block_size`,
128 x 128 as released); the real weight is weight * scale_inv of its block.

`KDASERVE_FP8_WEIGHTS` chooses what stays FP8 (with its scales, run by block-scaled FP8 GEMMs:
layers/linear.py, layers/moe.py); everything else is dequantized once at load into the model's dtype:
- `auto` (the default): the routed experts, where FP8 dots run (CUDA capability 8.9 and up): half
  their memory (most of a MoE model's bytes) at about the bf16 experts' speed, while the FP8
  linear projections, with their separate activation-quantization launch, are still slower than
  cuBLAS in bf16 (docs/models.md has the measurements).
- `keep`: the experts and the family's big linear projections, on any device (a CPU runs the
  Triton interpreter or the torch definition): half the weight memory, for now slower linears.
- `dequantize`: nothing.
`--quantization fp8` keeps the experts and linears whatever the policy and the checkpoint. A kept
weight that arrives unquantized is quantized at load (max|block| / 448 scales, as the release
does). A weight without its scale, or a scale without its weight, is an error naming it."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kdaserve.layers.distributed import tp_size
from kdaserve.ops.fp8.reference import quantize_blocks

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, n))


def fp8_block_size(config_extra: dict) -> tuple[int, int]:
    """weight_block_size of a config's quantization_config (top level or the outer config of a
    nested one); 128 x 128 when absent."""
    q = config_extra.get("quantization_config") or (config_extra.get("outer_config") or {}).get("quantization_config") or {}
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive sizes, got {block}")
    return int(block[0]), int(block[1])


FP8_POLICY_ENV = "KDASERVE_FP8_WEIGHTS"


def is_fp8_checkpoint(config_extra: dict) -> bool:
    q = config_extra.get("quantization_config") or (config_extra.get("outer_config") or {}).get("quantization_config") or {}
    return q.get("quant_method") == "fp8"


def fp8_policy() -> str:
    policy = os.environ.get(FP8_POLICY_ENV, "auto")
    if policy not in ("auto", "keep", "dequantize"):
        raise ValueError(f"{FP8_POLICY_ENV}={policy!r}: expected auto, keep or dequantize")
    return policy


def kept_fp8_block(config_extra: dict, device) -> tuple[int, int] | None:
    """The block size when this model keeps FP8 experts on `device`, else None (dequantize);
    `fp8_policy() == "keep"` keeps the linear projections too."""
    if not is_fp8_checkpoint(config_extra):
        return None
    policy = fp8_policy()
    if policy == "dequantize":
        return None
    device = torch.device(device) if device is not None else torch.empty(0).device
    fp8_dots = (device.type == "cuda" and torch.version.hip is None
                and torch.cuda.get_device_capability(device) >= (8, 9))
    return fp8_block_size(config_extra) if policy == "keep" or fp8_dots else None


def fp8_blocks(config_extra: dict, widths: tuple[int, ...], device, quantization: str | None, family: str,
               say: bool = True) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(block of the FP8 experts, block of the FP8 linear projections), None where they are not
    FP8. `--quantization fp8` keeps both whatever the checkpoint; else the policy above decides.
    Merged gate|up weights need MLP `widths` of whole row blocks and FP8 dots K steps of at least
    32: where they do not hold, an FP8 checkpoint is dequantized (with a log line) and
    --quantization fp8 is an error naming both."""
    forced = quantization == "fp8"
    device = torch.device(device) if device is not None else torch.empty(0).device
    block = fp8_block_size(config_extra) if forced else kept_fp8_block(config_extra, device)
    if block is None:
        return None, None
    on_gpu = device.type == "cuda"
    unmet = ([f"the MLP widths {widths} must be multiples of the {block[0]}-row block"]
             if any(w % block[0] for w in widths) else [])
    if on_gpu and block[1] < 32:
        unmet.append(f"FP8 dots take K steps of at least 32, the blocks are {block}")
    if unmet and forced:
        raise ValueError(f"--quantization fp8 cannot run this model: {'; '.join(unmet)}")
    if unmet:
        log.warning("FP8 weights dequantized: %s", "; ".join(unmet))
        return None, None
    linears = block if forced or fp8_policy() == "keep" else None
    if say:   # once per model: the capacity check asks the same question quietly
        log.info("%s: FP8 weights (%d x %d blocks) for the routed experts%s", family, *block,
                 " and the linear projections" if linears else "")
    return block, linears


@dataclass(frozen=True)
class Fp8Layout:
    """Which released tensors of a model family stay FP8: by their name inside a layer (`layer`
    matches (index, rest)), the routed experts' always, the dense and shared MLPs' and the
    attention layers' projections with the linears. One per family (models/glm5_next.py,
    models/kimi_linear.py)."""

    family: str
    layer: re.Pattern
    experts: re.Pattern
    mlps: re.Pattern
    attention: re.Pattern
    is_attention_layer: Callable[[object, int], bool]   # (config, layer index)
    widths: Callable[[object], tuple[int, ...]]        # the MLP widths merged gate|up weights split
    # The attention projections' widths tensor parallelism splits (MLA: q / q_b's rows, o_proj's columns)
    attention_widths: Callable[[object], tuple[int, ...]] = lambda c: mla_split_widths(c)

    def keeps(self, config, name: str, linears: bool = False) -> bool:
        """Whether a model keeping FP8 experts (`linears`: and linear projections) keeps `name` FP8."""
        m = self.layer.fullmatch(name)
        if m is None:
            return False
        i, rest = int(m[1]), m[2]
        if self.experts.fullmatch(rest):
            return True
        if not linears:
            return False
        return bool(self.mlps.fullmatch(rest)) or (self.is_attention_layer(config, i)
                                                   and self.attention.fullmatch(rest) is not None)

    def blocks(self, config, device, quantization: str | None, say: bool = True) -> tuple[tuple[int, int] | None, ...]:
        """(block of the FP8 experts, block of the FP8 linear projections), None where not FP8. The
        widths are this rank's (tensor parallel): a rank's share that splits a block dequantizes an
        FP8 checkpoint, and makes --quantization fp8 an error naming the widths."""
        n = tp_size()
        widths = tuple(w // n for w in self.widths(config))
        try:
            blocks = fp8_blocks(config.extra, widths, device, quantization, self.family, say)
        except ValueError as exc:
            if n == 1:
                raise
            raise ValueError(f"{exc} (each rank's share of {self.widths(config)} at --tensor-parallel-size {n}); "
                             f"a smaller -tp keeps whole blocks, or leave --quantization unset") from None
        linears = blocks[1]
        whole = self.attention_widths(config)
        splits = lambda m: m > 1 and any((w // m) % b for w in whole for b in linears)   # noqa: E731
        if linears is not None and splits(n):   # (one rank's weights are whole: their last block may be short)
            fits = [m for m in range(1, config.num_attention_heads + 1)
                    if config.num_attention_heads % m == 0 and not splits(m)]
            raise ValueError(f"FP8 attention projections need each rank's share of the heads' widths {whole} in "
                             f"whole {linears[0]} x {linears[1]} blocks; at --tensor-parallel-size {n} a rank holds "
                             f"{tuple(w // n for w in whole)}; the sizes that keep whole blocks: "
                             f"{', '.join(map(str, fits))} (or leave --quantization unset)")
        return blocks

    def tensors(self, config, device, quantization: str | None) -> Callable[[str], bool] | None:
        """Which released tensors a model built so keeps in FP8 (the capacity check's question)."""
        experts, linears = self.blocks(config, device, quantization, say=False)
        return (lambda name: self.keeps(config, name, linears is not None)) if experts else None

    def with_scales(self, config, shapes: dict[str, tuple[int, ...]], block: tuple[int, int] | None,
                    linears: bool) -> dict[str, tuple[int, ...]]:
        """`shapes` plus the `weight_scale_inv` of every tensor kept in FP8 (none without a block)."""
        if block is None:
            return shapes
        br, bc = block
        return {**shapes, **{name + SCALE_SUFFIX: (-(-shapes[name][0] // br), -(-shapes[name][1] // bc))
                             for name in shapes if self.keeps(config, name, linears)}}

    def four_bit_experts(self, config, shapes: Callable[[], dict[str, tuple[int, ...]]],
                         fp8_block: tuple[int, int] | None):
        """What stays 4-bit (models/fp4.FourBitExperts): nothing where the model keeps FP8 experts
        (--quantization fp8 over a 4-bit checkpoint dequantizes it first). `shapes()`: the released
        shapes, asked for only when the checkpoint is a 4-bit one."""
        from kdaserve.models.fp4 import NO_FOUR_BIT_EXPERTS, four_bit_experts

        return (NO_FOUR_BIT_EXPERTS if fp8_block
                else four_bit_experts(config.extra, shapes, self.layer, self.experts, self.mlps))

    def four_bit_tensors(self, config, shapes: dict[str, tuple[int, ...]], device,
                         quantization: str | None) -> Callable[[str], int | None]:
        """The group size of each released weight a model built so keeps in 4 bits (the capacity
        check's question), None for the others."""
        from kdaserve.ops.fp4.weights import SCHEME_GROUP

        experts = self.four_bit_experts(config, lambda: shapes, self.blocks(config, device, quantization, say=False)[0])

        def group(name: str) -> int | None:
            module = name.removesuffix(".weight")
            return SCHEME_GROUP[experts.scheme_of(module)] if name.endswith(".weight") and experts.keeps(module) else None
        return group

    def checkpoint_weights(self, model, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's tensors as `model` (built with this layout's `blocks`) takes them: kept
        weights FP8 with their scales, the rest dequantized into the embedding's dtype; a 4-bit
        checkpoint's layers (models/fp4.py) dequantized into it first, but for the experts the model
        keeps in 4 bits (`model.fp4_experts`)."""
        from kdaserve.models.fp4 import dequantized_fp4_weights, fp4_layout

        config, block, linears = model.config, model.fp8_block, model.fp8_linear_block is not None
        dtype = model.model.embed_tokens.weight.dtype
        if (four_bit := fp4_layout(config.extra)) is not None:
            weights = dequantized_fp4_weights(weights, four_bit, dtype, keep=model.fp4_experts.keeps)
        return dequantized_weights(weights, dtype, block or fp8_block_size(config.extra),
                                   keep=(lambda name: self.keeps(config, name, linears)) if block else None)


def mla_split_widths(config) -> tuple[int, ...]:
    """An MLA layer's widths split by heads that a block-scaled FP8 weight holds: the query
    projection's rows (q_proj or q_b_proj) and o_proj's columns (the latent projections are whole
    on every rank; kv_b_proj stays in the model's dtype)."""
    heads = config.num_attention_heads
    return heads * (config.qk_nope_head_dim + config.qk_rope_head_dim), heads * config.v_head_dim


def _check_scale(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> None:
    rows, cols = weight.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}; a [{rows}, {cols}] weight in "
                         f"{br} x {bc} blocks needs {list(want)}")


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                         name: str = "weight") -> torch.Tensor:
    _check_scale(weight, scale_inv, block, name)
    rows, cols = weight.shape
    br, bc = block
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                        block: tuple[int, int] = (128, 128),
                        keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with FP8 weights dequantized and their scales consumed, except the
    weights `keep` names: those come out as FP8 with their `_scale_inv` (quantized here if they
    arrive unquantized). A weight and its scale may arrive in either order (different shards)."""
    keep = keep or (lambda name: False)
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}

    def pair(base: str, w: torch.Tensor, scale: torch.Tensor):
        if not keep(base):
            yield base, dequantize_block_fp8(w, scale, block, dtype, base)
            return
        _check_scale(w, scale, block, base)
        yield base, w
        yield base + SCALE_SUFFIX, scale.float()

    for name, t in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base in weights_waiting:
                yield from pair(base, weights_waiting.pop(base), t)
            else:
                scales_waiting[base] = t
        elif t.dtype in FP8_DTYPES:
            if name in scales_waiting:
                yield from pair(name, t, scales_waiting.pop(name))
            else:
                weights_waiting[name] = t
        elif keep(name):
            q, scale = quantize_blocks(t, block)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, t
    if weights_waiting:
        raise ValueError(f"FP8 weights without their {SCALE_SUFFIX}: {sorted(weights_waiting)[:8]}")
    if scales_waiting:
        raise ValueError(f"{SCALE_SUFFIX} tensors without an FP8 weight: {sorted(s + SCALE_SUFFIX for s in scales_waiting)[:8]}")
