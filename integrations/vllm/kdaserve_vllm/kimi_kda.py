"""Kimi-Linear's KDA layer in vLLM with kdaserve's core: `KdaserveKimiKDA` subclasses vLLM's
`KimiGatedDeltaNetAttention` and overrides only `_forward`, the KDA core between vLLM's projections
and its o_proj. vLLM's invariants, kept:

- inputs are strided views of vLLM's fused projection, `num_actual_tokens` real rows (the rest is
  CUDA-graph padding, never touched); the output goes into the caller's `core_attn_out`, the gated
  output norm included (vLLM's Kimi layer applies it inside `_forward`), nothing returned;
- `eager_break_during_capture` stays the outermost decorator;
- the paged state is vLLM's as laid out: conv state SD or DS with merged q|k|v channels, recurrent
  state [slots, H, D, D] in the dtype vLLM chose, slot indices <= 0 padding; speculative steps (2-D
  slot indices, accepted counts) take kdaserve's verify path;
- a step's tokens are routed as vLLM routes them: speculative verifies apart (spec_token_indx),
  the rest as one varlen prefill when any prefill is present (decodes then count as 1-token
  prefills with their state), else as plain decodes.

Requirements are checked at construction by kdaserve's resolver: an explicit backend that cannot
run here is an error listing every unmet requirement (no fallback). A phase may stay vLLM's
(`vllm`, or `auto` where kdaserve is not measured faster: kdaserve_vllm/options.py)."""

from __future__ import annotations

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform

from kdaserve.backends import KDABackendChoice, LayerSettings, Machine, resolve_kda_backends
from kdaserve.backends.step import KDACache, KDAInputs, KDAStepMetadata
from kdaserve.layers.kda_routing import run_kda_step
from kdaserve.ops.types import KDAWeights
from kdaserve_vllm.options import plugin_options

# Under "vllm." so vLLM's logging configuration (handlers, process prefixes) applies to our lines.
logger = init_logger("vllm.plugins.kdaserve")

_STOCK_FORWARD = getattr(KimiGatedDeltaNetAttention._forward, "__wrapped__", KimiGatedDeltaNetAttention._forward)
# vLLM's FusedRMSNormGated for Kimi is built with its default eps, whatever the config says.
_VLLM_O_NORM_EPS = 1e-5


class KdaserveKimiKDA(KimiGatedDeltaNetAttention):
    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        self.kdaserve_options = plugin_options(vllm_config.additional_config)
        self.kdaserve_backends = None
        if self.kdaserve_options is None:
            return
        _, state_dtype = self.get_state_dtype()
        conv_layout = "DS" if is_conv_state_dim_first() else "SD"
        settings = LayerSettings(input_dtype=self.model_config.dtype, head_dim=self.head_dim,
                                 lower_bound=self.gate_lower_bound, state_dtype=state_dtype, conv_layout=conv_layout,
                                 num_spec_tokens=self.num_spec, conv_width=self.conv_size)
        opts = self.kdaserve_options
        choice = KDABackendChoice(prefill=opts.kdaserve_choice("prefill"), decode=opts.kdaserve_choice("decode"),
                                  state_dtype=state_dtype, conv_layout=conv_layout, num_spec_tokens=self.num_spec)
        device = torch.device(current_platform.device_type)
        bounded = self.gate_lower_bound is not None
        # Phases left to vLLM's kernels: a step with prefills follows the prefill phase's choice
        # (vLLM runs its decodes as 1-token prefills then), any other step the decode phase's.
        self.kdaserve_vllm_phases = {p for p in ("prefill", "decode") if opts.uses_vllm(p, device.type, bounded)}
        # Raises kdaserve's BackendError listing every unmet requirement of an explicit choice.
        self.kdaserve_backends = resolve_kda_backends(choice, settings, self.local_num_heads, Machine.detect(device),
                                                      log=False)
        self._conv_weight_decode = None
        # One line per process and layer kind, so a run shows which class each process built.
        names = {p: "vllm" if p in self.kdaserve_vllm_phases else getattr(self.kdaserve_backends, p).name
                 for p in ("prefill", "decode")}
        logger.info_once("kdaserve_vllm: %s built for KimiGatedDeltaNetAttention (tp rank %d of %d): KDA prefill %s, "
                         "decode %s", type(self).__name__, self.tp_rank, self.tp_size, names["prefill"], names["decode"])

    # ---- the KDA core -------------------------------------------------------------------------------

    def _kda_weights(self) -> KDAWeights:
        P3, W = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        conv = self.conv1d.weight.view(P3, W)
        layout = self.kdaserve_backends.decode.conv_weight_decode_layout()
        if layout is not None and (self._conv_weight_decode is None or self._conv_weight_decode.device != conv.device):
            # Built on first use, after vLLM has loaded the weights (they never change after).
            self._conv_weight_decode = layout(conv).clone()
        return KDAWeights(conv_weight=conv, A_log=self.A_log, dt_bias=self.dt_bias.view(self.local_num_heads, self.head_dim),
                          norm_weight=self.o_norm.weight, lower_bound=self.gate_lower_bound, norm_eps=_VLLM_O_NORM_EPS,
                          conv_weight_decode=self._conv_weight_decode)

    def _run(self, meta: KDAStepMetadata, rows: torch.Tensor | slice, mixed_qkv, g1, g2, beta, cache, weights,
             pad: tuple[torch.Tensor, int] | None = None):
        """One part of the step (tokens `rows`) through kdaserve's router; returns its output [n, H, D].
        `pad` = (destination row of each token, rows in all): the tokens are spread over that many
        zero rows first (a ragged verify padded to S+1 rows per sequence) and gathered back after."""
        take = (lambda x: x[rows]) if isinstance(rows, slice) else (lambda x: x.index_select(0, rows))
        parts = [take(mixed_qkv), take(g1), take(beta), take(g2)]
        if pad is not None:
            dest, total = pad
            parts = [x.new_zeros(total, *x.shape[1:]).index_copy_(0, dest, x) for x in parts]
        inputs = KDAInputs(qkv=parts[0], forget_logits=parts[1], beta_logits=parts[2], output_gate_logits=parts[3])
        out = torch.empty(inputs.qkv.shape[0], self.local_num_heads, self.head_dim, dtype=g2.dtype, device=g2.device)
        plan = self.kdaserve_backends.plan_step(meta)
        run_kda_step(meta, plan, inputs, weights, cache, out, self.kdaserve_backends)
        return out if pad is None else out.index_select(0, pad[0])

    @staticmethod
    def _ragged_rows(cu: torch.Tensor, n: int, rows_per_seq: int, num_tokens: int) -> torch.Tensor:
        """Row of each verify token when every sequence gets `rows_per_seq` rows (no host sync)."""
        lengths = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(n, device=cu.device), lengths, output_size=num_tokens)
        within = torch.arange(num_tokens, device=cu.device) - cu[:-1].index_select(0, seq)
        return seq * rows_per_seq + within

    @eager_break_during_capture
    def _forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        if self.kdaserve_backends is None:
            return _STOCK_FORWARD(self, mixed_qkv, g1, g2, beta, core_attn_out)
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return
        m = metadata.get(self.prefix)
        if m is None:   # profile / warm-up dummy runs carry no KDA metadata
            return
        if ("prefill" if m.num_prefills else "decode") in self.kdaserve_vllm_phases:
            return _STOCK_FORWARD(self, mixed_qkv, g1, g2, beta, core_attn_out)
        T = m.num_actual_tokens
        conv_state, recurrent_state = self.kv_cache
        cache = KDACache(conv_state, recurrent_state, "DS" if is_conv_state_dim_first() else "SD")
        weights = self._kda_weights()
        g1, beta, g2 = g1[0, :T], beta[0, :T], g2[:T]
        mixed_qkv = mixed_qkv[:T]
        out = core_attn_out[0, :T]
        spec_only = m.spec_sequence_masks is not None and m.num_prefills == 0 and m.num_decodes == 0
        if m.spec_sequence_masks is not None:
            n, width = m.num_spec_decodes, m.spec_state_indices_tensor.shape[1]
            slots = m.spec_state_indices_tensor[:n]
            meta = KDAStepMetadata(num_decodes=n, num_decode_tokens=n * width, decode_state_indices=slots[:, 0],
                                   spec_state_indices=slots, num_accepted_tokens=m.num_accepted_tokens[:n])
            rows = slice(0, T) if spec_only else m.spec_token_indx
            pad = None
            if m.num_spec_decode_tokens != n * width:
                # vLLM verifies fewer tokens where it found fewer drafts; kdaserve's verify takes S+1
                # rows per sequence: the missing rows are zeros whose states land in slots past the
                # sequence's tokens, which vLLM never resumes from (it resumes at the accepted count).
                pad = (self._ragged_rows(m.spec_query_start_loc[: n + 1], n, width, m.num_spec_decode_tokens), n * width)
            part = self._run(meta, rows, mixed_qkv, g1, g2, beta, cache, weights, pad)
            if spec_only:
                out.copy_(part)
                return
            out.index_copy_(0, m.spec_token_indx, part)
        rows = slice(0, T) if m.spec_sequence_masks is None else m.non_spec_token_indx
        n_tokens = T if m.spec_sequence_masks is None else m.non_spec_token_indx.numel()
        n_seqs = m.num_prefills + m.num_decodes
        slots = m.non_spec_state_indices_tensor[:n_seqs]
        if m.num_prefills:
            cu = m.non_spec_query_start_loc[: n_seqs + 1]
            meta = KDAStepMetadata(num_prefills=n_seqs, num_prefill_tokens=n_tokens, prefill_cu_seqlens=cu,
                                   prefill_state_indices=slots, prefill_has_initial_state=m.has_initial_state[:n_seqs])
        else:
            meta = KDAStepMetadata(num_decodes=n_seqs, num_decode_tokens=n_seqs, decode_state_indices=slots)
        part = self._run(meta, rows, mixed_qkv, g1, g2, beta, cache, weights)
        if m.num_prefills and self.num_spec:
            self._history_to_front(conv_state, slots)
        if isinstance(rows, slice):
            out.copy_(part)
        else:
            out.index_copy_(0, rows, part)

    def _history_to_front(self, conv_state: torch.Tensor, slots: torch.Tensor) -> None:
        """With speculation the conv state holds W-1+S rows. kdaserve's prefill leaves the newest W-1
        inputs at the end (where its verify resumes with S+1 accepted); vLLM's next verify resumes
        after 1 accepted row, from the front. Move them there (no host sync: padding slots copy
        their own rows back)."""
        W1, S = self.conv_size - 1, self.num_spec
        sd = not is_conv_state_dim_first()
        idx = slots.long().clamp_min(0)
        rows = conv_state.index_select(0, idx)
        tail = rows[:, S:S + W1] if sd else rows[:, :, S:S + W1]
        valid = (slots > 0).view(-1, 1, 1)
        if sd:
            rows[:, :W1] = torch.where(valid, tail, rows[:, :W1])
        else:
            rows[:, :, :W1] = torch.where(valid, tail, rows[:, :, :W1])
        conv_state.index_copy_(0, idx, rows)
