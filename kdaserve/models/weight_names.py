"""Checkpoint names and shapes of the hybrid model, and the routing of named tensors onto its
parameters (merged q|k|v and gate|up shards, whole KDA layers)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import torch

from kdaserve.layers.distributed import local_slice
from kdaserve.models.hybrid_config import HybridConfig

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(linear_attn|self_attn)\.(.+)")


def checkpoint_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a complete checkpoint of this config holds, with its shape."""
    c = config
    h, V = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, h)
    H, D, W = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    P = H * D
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes[a + "in_proj_qkvbfg_a.weight"] = (3 * P + H + 2 * D, h)
            shapes[a + "f_b_proj.weight"] = (P, D)
            shapes[a + "g_b_proj.weight"] = (P, D)
            for x in "qkv":
                shapes[a + f"{x}_conv1d.weight"] = (P, 1, W)
            shapes[a + "A_log"] = (H,)
            shapes[a + "dt_bias"] = (P,)
            shapes[a + "o_norm.weight"] = (D,)
            shapes[a + "o_proj.weight"] = (h, P)
        else:
            a = p + "self_attn."
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            for n, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[a + f"{n}.weight"] = (rows, h)
                if c.attention_bias:
                    shapes[a + f"{n}.bias"] = (rows,)
            shapes[a + "o_proj.weight"] = (h, q)
    return shapes


def _canonical(name: str, config: HybridConfig) -> str:
    """KDA tensors may be stored under `self_attn.` too; name them `linear_attn.`."""
    m = _LAYER_NAME.fullmatch(name)
    if m and int(m[1]) < config.num_hidden_layers and config.layer_types[int(m[1])] == "linear_attention":
        return f"model.layers.{m[1]}.linear_attn.{m[3]}"
    return name


def _skipped(name: str, config: HybridConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m[1]) >= config.num_hidden_layers   # e.g. multi-token-prediction layers


def load_named_tensor(root, name: str, tensor: torch.Tensor, params: dict | None = None) -> bool:
    """Copy a checkpoint tensor into the parameter of `root` it names: a shard of a merged
    parameter where the parent module declares `packed_modules` (q|k|v, gate|up), else the
    parameter of that name. False when `root` has no such parameter."""
    module_path, _, pname = name.rpartition(".")
    parent_path, _, child = module_path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    packed = getattr(parent, "packed_modules", {})
    if child in packed:
        target, shard = packed[child]
        parent.get_submodule(target).load_shard(pname, shard, tensor)
        return True
    params = params if params is not None else dict(root.named_parameters())
    if name not in params:
        return False
    param = params[name]
    # Through the parameter, not .data: the write moves its version counter, which what is derived
    # from it keys on (ops/fp4/word_decode.largest_code). Tensor parallel: this rank's slice.
    with torch.no_grad():
        param.copy_(local_slice(tensor, param.shape))
    return True


def route_weights(model, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> set[str]:
    """Copy named checkpoint tensors into `model` (a HybridForCausalLM). Returns the canonical
    names loaded. strict: unknown names, wrong shapes and missing tensors are errors."""
    config: HybridConfig = model.config
    params = dict(model.named_parameters())
    kda_items: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    loaded: set[str] = set()
    unexpected: list[str] = []
    shapes = checkpoint_shapes(config)
    for raw_name, tensor in weights:
        if _skipped(raw_name, config):
            continue
        name = _canonical(raw_name, config)
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"checkpoint tensor {raw_name} has shape {tuple(tensor.shape)}; expected {shapes[name]}")
        m = _LAYER_NAME.fullmatch(name)
        if m and m[2] == "linear_attn":
            kda_items[int(m[1])].append((m[3], tensor))
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            embed = params["model.embed_tokens.weight"]
            with torch.no_grad():
                embed.copy_(local_slice(tensor, embed.shape))
        elif not load_named_tensor(model, name, tensor, params):
            unexpected.append(raw_name)
            continue
        loaded.add(name)
    for i, items in kda_items.items():
        layer = model.model.layers[i].linear_attn
        used = layer.load_weights(items)
        loaded |= {f"model.layers.{i}.linear_attn.{n}" for n in used}
        unexpected += [f"model.layers.{i}.linear_attn.{n}" for n, _ in items if n not in used]
    if strict:
        if unexpected:
            raise ValueError(f"checkpoint has tensors the model does not know: {sorted(unexpected)[:10]}")
        missing = sorted(set(shapes) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:10]}")
    return loaded
