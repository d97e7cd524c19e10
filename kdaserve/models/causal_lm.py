"""What every model family gives the engine, in one place: `forward(input_ids [T], positions [T])
-> hidden [T, hidden]`, `compute_logits` (fp32), `kda_layers`, `attention_layers`, and the KDA
backends resolved once for all KDA layers (they share their settings; logged once).

The loader resolves the KDA backends once (`kda_backends_for`) and passes the pair to the model,
which hands it to every KDA layer; the engine keeps the loader's pair. A family subclasses
KDACausalLM: it builds `self.model` (an `embed_tokens`, `layers` each with `is_kda` and `mixer`, and
a final norm), then calls `add_head`."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.backends import KDABackendChoice, KDABackends, LayerSettings, Machine, resolve_kda_backends
from kdaserve.layers.distributed import split
from kdaserve.layers.embed_head import LMHead


class DecoderStack(nn.Module):
    """embed_tokens -> pre-norm decoder layers (each `layer(positions, hidden, residual) -> (hidden,
    residual)`, the residual add fused into the next norm) -> norm. Families build the three parts."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class PreNormDecoderLayer(nn.Module):
    """A layer of DecoderStack: input_layernorm, the mixer (a KDA layer takes the hidden states, an
    attention layer the positions too), post_attention_layernorm, the feed-forward; each norm adds
    the residual first. A family builds the parts (with `is_kda`); `mixer` and `feed_forward` name
    them: self_attn and mlp unless the family stores them under other released names."""

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def feed_forward(self) -> nn.Module:
        return self.mlp

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mixer(hidden) if self.is_kda else self.mixer(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


def kda_backends_for(config, choice: KDABackendChoice, dtype: torch.dtype, device, *, log: bool = True) -> KDABackends | None:
    """The backends of every KDA layer of `config` (its linear_num_heads, linear_head_dim,
    linear_conv_kernel_dim, linear_lower_bound: None is the unbounded gate, and linear_round_gate
    where the family rounds its gate to the activation dtype) with activations in `dtype`, or None
    without KDA layers. Logs the pair once when `log`."""
    if "linear_attention" not in config.layer_types:
        return None
    settings = LayerSettings(input_dtype=dtype, head_dim=config.linear_head_dim, lower_bound=config.linear_lower_bound,
                             state_dtype=choice.state_dtype, conv_layout=choice.conv_layout,
                             num_spec_tokens=choice.num_spec_tokens, conv_width=config.linear_conv_kernel_dim,
                             round_gate=getattr(config, "linear_round_gate", False))
    machine = Machine.detect(torch.device(device) if device is not None else None)
    heads = split(config.linear_num_heads, "the KDA layers' num_heads")   # this rank's (tensor parallel)
    return resolve_kda_backends(choice, settings, heads, machine, log=log)


def check_kda_backends(config, kda_backends: KDABackends | None) -> None:
    """A model with KDA layers is built with their resolved pair (kda_backends_for)."""
    if kda_backends is None and "linear_attention" in config.layer_types:
        raise ValueError(f"{type(config).__name__} has KDA layers: pass kda_backends=kda_backends_for(config, choice, dtype, "
                         f"device), the pair every KDA layer shares")


class KDACausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        # The multi-token-prediction layer when built to draft (add_mtp). An instance attribute: a
        # class attribute would shadow the submodule nn.Module keeps in _modules.
        self.mtp: nn.Module | None = None

    def add_head(self, dtype, device) -> None:
        c = self.config
        tied = self.model.embed_tokens if c.tie_word_embeddings else None
        self.lm_head = LMHead(c.vocab_size, c.hidden_size, tied_to=tied, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, images=None) -> torch.Tensor:
        """`images`: (rows, embeddings) replacing those rows' token embeddings, for a family with a
        vision tower (its `image_token_id` not None; engine/encoder_cache.py)."""
        if images is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, images=images)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def kda_layers(self) -> list[nn.Module]:
        return [l.mixer for l in self.model.layers if l.is_kda]

    @property
    def attention_layers(self) -> list[nn.Module]:
        """The target's attention layers, then the MTP layer's (its caches share the block tables)."""
        return [l.mixer for l in self.model.layers if not l.is_kda] + ([self.mtp.mixer] if self.mtp is not None else [])

    def add_mtp(self, build) -> None:
        """The family's multi-token-prediction layer, `build()`, as the drafter of speculative method
        "mtp"; refused when the config has none."""
        if self.config.num_mtp_layers < 1:
            raise ValueError("speculative method 'mtp' needs a checkpoint with a multi-token-prediction layer, but this "
                             "config has num_nextn_predict_layers = 0; use the 'ngram' method instead")
        self.mtp = build()

    def draft_hidden(self, next_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor,
                     images=None) -> torch.Tensor:
        """The MTP layer over a step's rows (models/mtp_layer.py); compute_logits reads its output.
        `images`: (rows [R] int64, embeddings [R, hidden]) replacing those rows' next-token embeddings
        (rows whose next token is an image placeholder read the image's embedding, as the target did)."""
        x = self.model.embed_tokens(next_ids)
        if images is not None:
            rows, embeds = images
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        return self.mtp(x, positions, target_hidden)
