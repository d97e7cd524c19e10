"""What the families loaded from released checkpoints share (Kimi-Linear, GLM-5.3-Flash, Ling-3): the
tensor shapes of a KDA layer and an MLA layer under their released names, and the loading loop
that checks a checkpoint against the complete list of its config (an unknown name, a wrong shape
or a missing tensor is an error that names it) and routes each tensor to its parameter."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from kdaserve.layers.distributed import local_slice


def kda_layer_shapes(prefix: str, hidden: int, heads: int, head_dim: int, conv_width: int,
                     a_log_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """A KDA layer's released tensors (`prefix` ends with "self_attn.")."""
    H, D, P = heads, head_dim, heads * head_dim
    s = {prefix + n + ".weight": (rows, hidden)
         for n, rows in (("q_proj", P), ("k_proj", P), ("v_proj", P), ("b_proj", H), ("f_a_proj", D), ("g_a_proj", D))}
    s[prefix + "f_b_proj.weight"] = s[prefix + "g_b_proj.weight"] = (P, D)
    for x in "qkv":
        s[prefix + f"{x}_conv1d.weight"] = (P, 1, conv_width)
    s[prefix + "A_log"] = a_log_shape
    s[prefix + "dt_bias"] = (P,)
    s[prefix + "o_norm.weight"] = (D,)
    s[prefix + "o_proj.weight"] = (hidden, P)
    return s


def mla_layer_shapes(prefix: str, hidden: int, heads: int, *, nope: int, rope: int, v: int, kv_lora_rank: int,
                     q_lora_rank: int | None) -> dict[str, tuple[int, ...]]:
    """An MLA layer's released tensors (q-LoRA or a plain q_proj)."""
    qk = nope + rope
    s: dict[str, tuple[int, ...]] = {}
    if q_lora_rank is None:
        s[prefix + "q_proj.weight"] = (heads * qk, hidden)
    else:
        s[prefix + "q_a_proj.weight"] = (q_lora_rank, hidden)
        s[prefix + "q_a_layernorm.weight"] = (q_lora_rank,)
        s[prefix + "q_b_proj.weight"] = (heads * qk, q_lora_rank)
    s[prefix + "kv_a_proj_with_mqa.weight"] = (kv_lora_rank + rope, hidden)
    s[prefix + "kv_a_layernorm.weight"] = (kv_lora_rank,)
    s[prefix + "kv_b_proj.weight"] = (heads * (nope + v), kv_lora_rank)
    s[prefix + "o_proj.weight"] = (hidden, heads * v)
    return s


def moe_layer_shapes(prefix: str, hidden: int, experts: int, width: int, shared: int, *,
                     bias: str = "e_score_correction_bias",
                     parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, tuple[int, ...]]:
    """A MoE layer's released tensors (`prefix` ends with "mlp." or "block_sparse_moe."): the router
    `gate.weight` and its correction bias `gate.{bias}`, each expert's gate, up and down projection
    by the family's `parts` names (Kimi-Linear: w1, w3, w2), and `shared` shared experts as one MLP."""
    gate, up, down = parts
    s: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (experts, hidden), prefix + f"gate.{bias}": (experts,)}
    for e in range(experts):
        s[prefix + f"experts.{e}.{gate}.weight"] = s[prefix + f"experts.{e}.{up}.weight"] = (width, hidden)
        s[prefix + f"experts.{e}.{down}.weight"] = (hidden, width)
    if shared:
        s[prefix + "shared_experts.gate_proj.weight"] = s[prefix + "shared_experts.up_proj.weight"] = (width * shared, hidden)
        s[prefix + "shared_experts.down_proj.weight"] = (hidden, width * shared)
    return s


def skips_mtp_tensor(layer: int, rest: str, num_layers: int, drafting: bool, shared_copies: tuple[str, ...],
                     notes: set[str]) -> bool:
    """Whether a tensor of layer `layer` (>= num_layers: the multi-token-prediction layers) is
    skipped: all of them unless the model drafts (`drafting`), then those past the first and the
    layer's copies of the target's embedding and head (`shared_copies`). Adds one note per reason."""
    if layer < num_layers:
        return False
    if not drafting or layer > num_layers:
        notes.add(f"layers >= {num_layers} (the multi-token-prediction layer): not drafting "
                  f"(--speculative-config {{\"method\": \"mtp\"}} uses it)" if not drafting else
                  f"layers > {num_layers} (further MTP layers): one drafts every step")
        return True
    if rest in shared_copies:
        notes.add("the MTP layer's copies of the embedding and the head: the target's are used")
        return True
    return False


def load_released(model, weights: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], *,
                  family: str, layer_name: re.Pattern, skip: Callable[[str], bool], top_param: Callable[[str], str],
                  layer_tensor: Callable, layer_of: Callable | None = None,
                  rename: Callable[[str], str] | None = None) -> set[str]:
    """Copy released tensors into `model` (its `model.layers[i]` each with `is_kda`; KDA layers take
    their `self_attn.` tensors at once through `load_weights`). `layer_name` matches a layer tensor
    as (index, rest); other names go to the parameter `top_param(name)`; `layer_tensor(i, layer,
    rest, tensor, params)` places the rest; `layer_of(i)`: the module of layer i (default
    `model.model.layers[i]`; a drafter layer past them); `rename(rest)`: the model's name of a
    layer tensor's released name (Ling-3's `attention.dense` is `self_attn.o_proj`). Returns the
    (released) names loaded."""
    params = dict(model.named_parameters())
    kda_items: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    loaded: set[str] = set()
    unknown: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        if name not in shapes:
            unknown.append(name)
            continue
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"checkpoint tensor {name} has shape {list(tensor.shape)}; expected {list(shapes[name])}")
        m = layer_name.fullmatch(name)
        if m is None:
            param = params[top_param(name)]
            param.copy_(local_slice(tensor, param.shape))   # the embedding / LM head: this rank's vocabulary rows
        else:
            i, rest = int(m[1]), m[2] if rename is None else rename(m[2])
            layer = model.model.layers[i] if layer_of is None else layer_of(i)
            if layer.is_kda and rest.startswith("self_attn."):
                kda_items[i].append((rest.removeprefix("self_attn."), tensor))
            else:
                layer_tensor(i, layer, rest, tensor, params)
        loaded.add(name)
    for i, items in kda_items.items():
        model.model.layers[i].self_attn.load_weights(items)
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} tensors {family} does not have (released names expected), "
                         f"e.g. {sorted(unknown)[:8]}")
    missing = sorted(set(shapes) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors of this config, e.g. {missing[:8]}")
    return loaded
