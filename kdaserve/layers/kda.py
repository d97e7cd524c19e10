"""The KDA layer: weights of docs/kda-semantics.md section 4, backends resolved once at construction,
cache slots bound by the engine, and one `_forward` that routes every kind of step.

Why it is built this way:
- The merged conv weight `conv_weight` [3P, W] is ONE registered buffer and `q_conv1d.weight`,
  `k_conv1d.weight`, `v_conv1d.weight` are views of it: any write lands in the merged tensor, whose
  address never moves (CUDA graphs captured on it stay valid).
- Derived copies (the decode backend's conv-weight layout, e.g. `[3, W, P]` for `fused`) are
  rebuilt in place after every write path: the conv weight loaders (initial load, reload, a refit
  through `load_weights` or a direct `weight_loader` call) and device moves. A copy built once and
  never refreshed serves stale weights after a refit.
- `forward` allocates the core output buffer and calls `_forward`, which reads the step metadata
  from the context and runs decode / speculative / prefill / mixed / nothing. A CUDA graph captured
  on a decode batch replays the whole forward; prefill and mixed steps run `_forward` eagerly.
- One GEMM projects q|k|v, beta and both gates' inputs (`in_proj_qkvbfg_a`); with low-rank gates
  (Kimi-Linear, GLM) one batched GEMM then lifts f_a | g_a to P, with full-rank gates (Ling-3,
  `full_rank_gates`) the gate logits are rows of the first GEMM already.
- Projections are plain GEMMs in the activation dtype. With tp_size > 1 the weights are this rank's
  shard and the returned o_proj output is this rank's partial sum (the caller all-reduces).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.backends import KDABackendChoice, KDABackends, LayerSettings, Machine, ResolvedBackend, resolve_kda_backends
from kdaserve.backends.step import KDACache, KDAInputs
from kdaserve.layers.context import get_context
from kdaserve.layers.distributed import TensorParallel, all_reduce, tensor_parallel
from kdaserve.layers.kda_routing import run_kda_step
from kdaserve.layers.kda_weights import CONV_NAMES, KDAShard
from kdaserve.ops.kda.limits import check_lower_bound
from kdaserve.ops.kda.types import KDAWeights, check_conv_layout


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _Holder(nn.Module):
    """Holds one `weight` so parameter names read like the checkpoint's (`o_norm.weight`)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class _Linear(nn.Module):
    """Bias-free linear layer in the activation dtype (no init work: weights come from a loader)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, device):
        super().__init__()
        self.weight = _param(torch.empty(out_features, in_features, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class KDALayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, backends: KDABackends, *, norm_eps: float = 1e-5,
                 layer_idx: int = 0, tp_rank: int = 0, tp_size: int = 1, full_rank_gates: bool = False, device=None):
        """`backends`: the model's resolved pair (one resolution for all its KDA layers; the loader's),
        whose settings are the layer's: head size, conv width, gate, activation and state dtypes,
        conv layout, speculative tokens. `num_heads` counts every rank's heads; `backends` were
        resolved for this rank's. `full_rank_gates`: the gates' logits come from f_proj / g_proj
        [P, hidden] (Ling-3) rather than low-rank pairs. A layer built alone: `KDALayer.build`."""
        super().__init__()
        st = backends.settings
        check_conv_layout(st.conv_layout)
        check_lower_bound(st.lower_bound)
        device = torch.device(device) if device is not None else torch.empty(0).device
        self.shard = KDAShard(hidden_size, num_heads, st.head_dim, st.conv_width, tp_rank, tp_size, full_rank_gates)
        H, D, P, W = self.shard.heads, st.head_dim, self.shard.P, st.conv_width
        if backends.num_heads != H:
            raise ValueError(f"layer {layer_idx}: the KDA backends were resolved for {backends.num_heads} heads, but this "
                             f"layer has {H} on rank {tp_rank} of {tp_size}; resolve them for the layer's heads")
        self.hidden_size, self.num_heads, self.head_dim, self.conv_width = hidden_size, H, D, W
        self.layer_idx, self.lower_bound, self.norm_eps = layer_idx, st.lower_bound, norm_eps
        self.state_dtype, self.conv_layout, self.num_spec_tokens = st.state_dtype, st.conv_layout, st.num_spec_tokens
        self.act_dtype = act = st.input_dtype
        self.settings, self.backends = st, backends
        # The group the partial o_proj outputs are summed over: the process's when the layer is one
        # of its ranks' shards; a layer built alone (tp_size 1, or a test's shard) sums nothing.
        tp = tensor_parallel()
        self.tp = tp if tp.size == tp_size and tp_size > 1 else TensorParallel()

        kw = dict(dtype=act, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.in_proj_qkvbfg_a = _Linear(hidden_size, self.shard.in_proj_rows, **kw)
        # The forget and output gates' second low-rank projections, stacked: one batched GEMM for
        # both (project), with f_b_proj.weight and g_b_proj.weight views of it, like the conv taps.
        # Full-rank gates have none.
        self.register_buffer("gate_b_weight", None if full_rank_gates else torch.zeros(2, P, D, **kw), persistent=False)
        if not full_rank_gates:
            self.f_b_proj, self.g_b_proj = (_Holder(_param(w)) for w in self.gate_b_weight)
        self.o_proj = _Linear(P, hidden_size, **kw)
        self.register_buffer("conv_weight", torch.zeros(3 * P, W, **f32), persistent=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (_Holder(_param(v)) for v in self._conv_views())
        self.A_log = _param(torch.zeros(H, **f32))
        self.dt_bias = _param(torch.zeros(P, **f32))
        self.o_norm = _Holder(_param(torch.ones(D, **f32)))
        for name in self.shard.checkpoint_names:
            self.get_parameter(name).weight_loader = functools.partial(self._load_one, name)
        # torch's own reload path writes (or, with assign=True, replaces) the conv views directly.
        self.register_load_state_dict_post_hook(KDALayer._after_load_state_dict)

        self._conv_layout_fn = self.decode_backend.conv_weight_decode_layout()
        self.conv_weight_decode: torch.Tensor | None
        if self._conv_layout_fn is not None:
            self.register_buffer("conv_weight_decode", self._conv_layout_fn(self.conv_weight).clone(), persistent=False)
        else:
            self.conv_weight_decode = None

        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    # ---- weights --------------------------------------------------------------------------------

    @classmethod
    def build(cls, hidden_size: int, num_heads: int, head_dim: int, *, conv_kernel_size: int = 4,
              lower_bound: float | None = -5.0, norm_eps: float = 1e-5, layer_idx: int = 0, tp_rank: int = 0,
              tp_size: int = 1, full_rank_gates: bool = False, prefill_backend: str = "auto", decode_backend: str = "auto",
              state_dtype: torch.dtype = torch.float32, conv_layout: str = "SD", num_spec_tokens: int = 0,
              round_gate: bool = False, params_dtype: torch.dtype | None = None, device=None) -> "KDALayer":
        """A layer alone (tests, `kdaserve parity`): its own backends resolved from names, activations
        in `params_dtype` (default bf16 on a GPU, fp32 elsewhere). A model resolves once for all its
        layers (models/causal_lm.kda_backends_for) and passes the pair to the constructor."""
        check_conv_layout(conv_layout)
        check_lower_bound(lower_bound)
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        device = torch.device(device) if device is not None else torch.empty(0).device
        act = params_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        settings = LayerSettings(input_dtype=act, head_dim=head_dim, lower_bound=lower_bound, state_dtype=state_dtype,
                                 conv_layout=conv_layout, num_spec_tokens=num_spec_tokens, conv_width=conv_kernel_size,
                                 round_gate=round_gate)
        heads = KDAShard(hidden_size, num_heads, head_dim, conv_kernel_size, tp_rank, tp_size).heads
        choice = KDABackendChoice(prefill_backend, decode_backend, state_dtype, conv_layout, num_spec_tokens)
        backends = resolve_kda_backends(choice, settings, heads, Machine.detect(device), log=False)
        return cls(hidden_size, num_heads, backends, norm_eps=norm_eps, layer_idx=layer_idx, tp_rank=tp_rank,
                   tp_size=tp_size, full_rank_gates=full_rank_gates, device=device)

    def _conv_views(self) -> list[torch.Tensor]:
        P, W = self.shard.P, self.conv_width
        return [self.conv_weight[i * P : (i + 1) * P].view(P, 1, W) for i in range(3)]

    def _merged_views(self):
        """(holder, its view of a merged buffer): the conv taps and the gates' b projections."""
        gates = [] if self.gate_b_weight is None else zip((self.f_b_proj, self.g_b_proj), self.gate_b_weight)
        return [*zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), self._conv_views()), *gates]

    def _apply(self, fn, recurse=True):
        """Device moves convert parameters and buffers one by one: re-alias the views to the moved
        merged buffers and rebuild the derived copies (new addresses: capture graphs after)."""
        super()._apply(fn, recurse)
        for holder, view in self._merged_views():
            holder.weight.data = view
        self.refresh_derived_weights()
        return self

    @torch.no_grad()
    def _after_load_state_dict(self, incompatible_keys) -> None:
        """Conv and gate parameters that `load_state_dict(assign=True)` replaced are copied into their
        merged buffer (the kernels' and the batched GEMM's only source, at a fixed address) and
        re-aliased, replaced parameters get their weight_loader back, and derived copies follow."""
        for holder, view in self._merged_views():
            if holder.weight.data_ptr() != view.data_ptr() or holder.weight.shape != view.shape:
                view.copy_(holder.weight.reshape(view.shape))
                holder.weight = _param(view)
        for name in self.shard.checkpoint_names:  # replaced parameters lost their loader
            param = self.get_parameter(name)
            if not hasattr(param, "weight_loader"):
                param.weight_loader = functools.partial(self._load_one, name)
        self.refresh_derived_weights()

    @torch.no_grad()
    def refresh_derived_weights(self) -> None:
        """Rebuild every derived copy from its source, in place (its address is kept)."""
        if self._conv_layout_fn is None:
            return
        res = self._conv_layout_fn(self.conv_weight, out=self.conv_weight_decode)
        if res is not None and res.data_ptr() != self.conv_weight_decode.data_ptr():
            self.conv_weight_decode.copy_(res)

    @torch.no_grad()
    def _load_one(self, name: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """weight_loader of parameter `name`: takes the full checkpoint tensor, keeps this rank's shard."""
        param.data.copy_(self.shard.shard(name, loaded).reshape(param.shape))
        if name in CONV_NAMES:
            self.refresh_derived_weights()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full checkpoint tensors by name relative to the layer (initial load, reload or an
        in-place refit); every derived copy is refreshed. Returns the names loaded. The merged
        projection may come whole (`in_proj_qkvbfg_a.weight`) or as the released parts
        (q_proj, k_proj, v_proj, b_proj, then f_a_proj, g_a_proj or, full rank, f_proj, g_proj)."""
        loaded = set()
        names, parts = self.shard.checkpoint_names, self.shard.in_proj_parts
        for name, tensor in weights:
            if name in parts:
                rows, part = self.shard.in_proj_part(name, tensor)
                self.in_proj_qkvbfg_a.weight.data[rows].copy_(part)
                loaded.add(name)
                continue
            if name not in names:
                raise KeyError(f"unknown KDA checkpoint tensor {name!r}; valid names: {', '.join(names + parts)}")
            param = self.get_parameter(name)
            param.weight_loader(param, tensor)
            loaded.add(name)
        self.refresh_derived_weights()
        return loaded

    @property
    def kda_weights(self) -> KDAWeights:
        """The tensors the kernels read, as views of the layer's own (address-stable) tensors."""
        return KDAWeights(
            conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias.view(self.num_heads, self.head_dim),
            norm_weight=self.o_norm.weight, lower_bound=self.lower_bound, norm_eps=self.norm_eps,
            conv_weight_decode=self.conv_weight_decode,
            gate_dtype=self.act_dtype if self.settings.round_gate else None,
        )

    # ---- cache ----------------------------------------------------------------------------------

    def cache_spec(self) -> dict:
        """Per-slot shapes and dtypes of the two pools (the engine adds the leading slot dim)."""
        rows, C = self.conv_width - 1 + self.num_spec_tokens, 3 * self.shard.P
        conv_shape = (rows, C) if self.conv_layout == "SD" else (C, rows)
        H, D = self.num_heads, self.head_dim
        return {"conv": (conv_shape, self.act_dtype), "recurrent": ((H, D, D), self.state_dtype)}

    def bind_cache(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        spec = self.cache_spec()
        for what, pool, (shape, dtype) in (("conv", conv_state, spec["conv"]), ("recurrent", recurrent_state, spec["recurrent"])):
            if pool.dim() != len(shape) + 1 or tuple(pool.shape[1:]) != shape or pool.dtype != dtype:
                raise ValueError(
                    f"{what} pool must be [num_slots, {', '.join(map(str, shape))}] {dtype} "
                    f"(layer {self.layer_idx}, {self.conv_layout} layout), got {list(pool.shape)} {pool.dtype}"
                )
        if conv_state.shape[0] != recurrent_state.shape[0]:
            raise ValueError(f"conv and recurrent pools must have the same slot count, got {conv_state.shape[0]} and "
                             f"{recurrent_state.shape[0]}")
        if conv_state.device != self.conv_weight.device or recurrent_state.device != self.conv_weight.device:
            raise ValueError(f"pools must live on the layer's device {self.conv_weight.device}")
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    @property
    def cache(self) -> KDACache | None:
        """The bound pools (None until bind_cache)."""
        if self.conv_state is None or self.recurrent_state is None:
            return None
        return KDACache(self.conv_state, self.recurrent_state, self.conv_layout)

    @property
    def prefill_backend(self) -> ResolvedBackend:
        return self.backends.prefill

    @property
    def decode_backend(self) -> ResolvedBackend:
        return self.backends.decode

    @property
    def decode_graph_capturable(self) -> bool:
        """Whether a decode step of this layer may be captured in a CUDA graph (the reference syncs)."""
        return self.decode_backend.graph_capturable

    # ---- forward --------------------------------------------------------------------------------

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (qkv [T, 3P] view, beta logits [T, H] view, forget_logits [T, P], output_gate_logits [T, P])."""
        H, D, P = self.num_heads, self.head_dim, self.shard.P
        proj = self.in_proj_qkvbfg_a(hidden_states)
        T = proj.shape[0]
        qkv, beta_logits = proj[:, : 3 * P], proj[:, 3 * P : 3 * P + H]
        if self.gate_b_weight is None:   # full-rank gates: column views of the projection (kernels take strides)
            return qkv, beta_logits, proj[:, 3 * P + H : 4 * P + H], proj[:, 4 * P + H :]
        # f_a | g_a as [2, T, D] (strided rows of proj) times [2, D, P]: both gates in one GEMM.
        gates = torch.bmm(proj[:, 3 * P + H :].view(T, 2, D).transpose(0, 1), self.gate_b_weight.transpose(1, 2))
        return qkv, beta_logits, gates[0], gates[1]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        T = hidden_states.shape[0]
        qkv, beta_logits, forget_logits, output_gate_logits = self.project(hidden_states)
        core = torch.empty(T, self.num_heads, self.head_dim, dtype=self.act_dtype, device=hidden_states.device)
        self._forward(qkv, forget_logits, beta_logits, output_gate_logits, core)
        out = self.o_proj(core.view(T, self.shard.P))
        return all_reduce(out, self.tp)   # the ranks' partial sums (tensor parallel)

    def _forward(self, qkv, forget_logits, beta_logits, output_gate_logits, out: torch.Tensor) -> str:
        """The KDA core of one step into `out` [T, H, D], routed by the context's KDA step (built
        once per step by the backends: the model runner's, or a test's `backends.build_step`);
        returns the route ("none", "decode", "speculative", "prefill" or "mixed"). Without one
        (profiling and dummy runs) no state is touched and `out` is zeroed."""
        route = run_kda_step(get_context().kda, KDAInputs(qkv, forget_logits, beta_logits, output_gate_logits),
                             self.kda_weights, self.cache, out, self.backends)
        if route == "none":
            out.zero_()
        return route

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}x{self.head_dim} (rank {self.shard.tp_rank}/{self.shard.tp_size}), "
            f"gate={self.settings.gate}{' (full rank)' if self.gate_b_weight is None else ''}, "
            f"prefill={self.prefill_backend.name}, decode={self.decode_backend.name}, "
            f"state={self.state_dtype}, conv_layout={self.conv_layout}, spec={self.num_spec_tokens}"
        )
