"""kdaserve's KDA core behind a vLLM KDA layer: what the Kimi-Linear and GLM-5.3-Flash overrides
share (kimi_kda.py, glm_kda.py). Both vLLM layers hand their core the same tensors: `mixed_qkv`
[T, 3P] (raw, before the short conv), `g1` [1, T, H, D] forget-gate logits, `beta` [1, T, H] logits,
`g2` [T, H, D] output-gate logits, and a `core_attn_out` [1, T, H, D] to write; the same
`GDNAttentionMetadata` and the same paged state. vLLM's invariants, kept:

- inputs are strided views of vLLM's fused projection, `num_actual_tokens` real rows (the rest is
  CUDA-graph padding, never touched); the output goes into the caller's `core_attn_out`, the gated
  output norm included (kdaserve's backends fuse it), nothing returned (gdn_step.py, tested on
  vLLM's layouts without vLLM in tests/integrations/test_vllm_layouts.py);
- the paged state is vLLM's as laid out: conv state SD or DS with merged q|k|v channels, recurrent
  state [slots, H, D, D] in the dtype vLLM chose, slot indices <= 0 padding; speculative steps (2-D
  slot indices, accepted counts) take kdaserve's verify path.

A wrong answer is never silent: a state or input the core cannot take is an error naming the
layer, its tensor-parallel rank and the conv layout; with `check_nan` (the default) a step whose
inputs hold NaN (a layer before this one: vLLM's, not kdaserve's) or whose output kdaserve's core
filled with NaN stops the engine, saying which.

Requirements are checked at construction by kdaserve's resolver: an explicit backend that cannot
run here is an error listing every unmet requirement (no fallback). A phase may stay vLLM's
(`vllm`, or `auto` where kdaserve is not measured faster: kdaserve_vllm/options.py)."""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform

from kdaserve.backends import KDABackendChoice, LayerSettings, Machine, resolve_kda_backends
from kdaserve.backends.step import KDACache
from kdaserve.ops.kda.types import KDAWeights
from kdaserve_vllm.gdn_step import fail_on_nan, run_gdn_step
from kdaserve_vllm.options import plugin_options

# Under "vllm." so vLLM's logging configuration (handlers, process prefixes) applies to our lines.
logger = init_logger("vllm.plugins.kdaserve")

# vLLM's FusedRMSNormGated for both layers is built with its default eps, whatever the config says.
VLLM_O_NORM_EPS = 1e-5


class KdaserveKDACore:
    """Mixed into a subclass of a vLLM KDA layer, after the layer's own __init__. The subclass
    names the layer it replaces and gives its weights in kdaserve's form (`_conv_weight`,
    `_gate_weights`)."""

    upstream_name: str = ""

    def _kdaserve_setup(self, vllm_config, lower_bound: float | None) -> None:
        """Resolve the backends the options ask for (None when the plugin was not asked)."""
        self.kdaserve_options = plugin_options(vllm_config.additional_config)
        self.kdaserve_backends = None
        self._kdaserve_lower_bound = lower_bound
        self._conv_weight_decode = None
        if self.kdaserve_options is None:
            return
        _, state_dtype = self.get_state_dtype()
        conv_layout = "DS" if is_conv_state_dim_first() else "SD"
        settings = LayerSettings(input_dtype=self.model_config.dtype, head_dim=self.head_dim, lower_bound=lower_bound,
                                 state_dtype=state_dtype, conv_layout=conv_layout, num_spec_tokens=self.num_spec,
                                 conv_width=self.conv_size)
        opts = self.kdaserve_options
        choice = KDABackendChoice(prefill=opts.kdaserve_choice("prefill"), decode=opts.kdaserve_choice("decode"),
                                  state_dtype=state_dtype, conv_layout=conv_layout, num_spec_tokens=self.num_spec)
        device = torch.device(current_platform.device_type)
        # Phases left to vLLM's kernels: a step with prefills follows the prefill phase's choice
        # (vLLM runs its decodes as 1-token prefills then), any other step the decode phase's.
        self.kdaserve_vllm_phases = {p for p in ("prefill", "decode")
                                     if opts.uses_vllm(p, device.type, lower_bound is not None)}
        # Raises kdaserve's BackendError listing every unmet requirement of an explicit choice.
        self.kdaserve_backends = resolve_kda_backends(choice, settings, self.local_num_heads, Machine.detect(device),
                                                      log=False)
        # What a failing step says, built once here rather than in every step.
        self._kdaserve_where = (f"kdaserve_vllm: KDA layer {self.prefix} (tp rank {self.tp_rank} of {self.tp_size}, "
                                f"conv state layout {conv_layout})")
        self._kdaserve_nan_in = (f"{self._kdaserve_where}: its inputs hold NaN, so a layer before it (vLLM's, not "
                                 "kdaserve's KDA core) produced NaN; docs/vllm-plugin.md lists the known causes")
        self._kdaserve_nan_out = (f"{self._kdaserve_where}: kdaserve's KDA core (prefill "
                                  f"{self.kdaserve_backends.prefill.name}, decode {self.kdaserve_backends.decode.name}) "
                                  "wrote NaN from inputs without NaN: a kdaserve bug, please report it with this line")
        # One line per process and layer kind, so a run shows which class each process built.
        names = {p: "vllm" if p in self.kdaserve_vllm_phases else getattr(self.kdaserve_backends, p).name
                 for p in ("prefill", "decode")}
        logger.info_once("kdaserve_vllm: %s built for %s (tp rank %d of %d): KDA prefill %s, decode %s",
                         type(self).__name__, self.upstream_name, self.tp_rank, self.tp_size, names["prefill"],
                         names["decode"])

    # ---- the layer's weights in kdaserve's form ---------------------------------------------------

    def _conv_weight(self) -> torch.Tensor:
        """[3P, W] merged q|k|v short-conv weight (a view where the layer stores it merged)."""
        raise NotImplementedError

    def _gate_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_log [H], dt_bias [H, D]) of this rank's heads."""
        raise NotImplementedError

    def _kda_weights(self) -> KDAWeights:
        conv = self._conv_weight()
        layout = self.kdaserve_backends.decode.conv_weight_decode_layout()
        if layout is not None and (self._conv_weight_decode is None or self._conv_weight_decode.device != conv.device):
            # Built on first use, after vLLM has loaded the weights (they never change after).
            self._conv_weight_decode = layout(conv).clone()
        A_log, dt_bias = self._gate_weights()
        return KDAWeights(conv_weight=conv, A_log=A_log, dt_bias=dt_bias, norm_weight=self.o_norm.weight,
                          lower_bound=self._kdaserve_lower_bound, norm_eps=VLLM_O_NORM_EPS,
                          conv_weight_decode=self._conv_weight_decode)

    # ---- the core -----------------------------------------------------------------------------------

    def _kdaserve_core(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                       core_attn_out: torch.Tensor) -> bool:
        """The step's KDA core into core_attn_out, gated norm included (gdn_step.py); False when
        this step's phase is left to vLLM (the caller runs vLLM's core). Profile and warm-up runs
        without KDA metadata write nothing."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return True
        m = metadata.get(self.prefix)
        if m is None:   # profile / warm-up dummy runs carry no KDA metadata
            return True
        if ("prefill" if m.num_prefills else "decode") in self.kdaserve_vllm_phases:
            return False
        conv_state, recurrent_state = self.kv_cache
        cache = KDACache(conv_state, recurrent_state, "DS" if is_conv_state_dim_first() else "SD")
        T = m.num_actual_tokens
        check = self.kdaserve_options.check_nan
        if check:
            fail_on_nan([mixed_qkv[:T], g1[:, :T], g2[:T], beta[:, :T]], self._kdaserve_nan_in)
        try:
            run_gdn_step(m, self.kdaserve_backends, mixed_qkv, g1, g2, beta, core_attn_out, cache, self._kda_weights(),
                         self.num_spec)
        except Exception as exc:   # a shape, dtype or layout kdaserve's checks refuse, named with the layer
            raise RuntimeError(f"{self._kdaserve_where}: kdaserve cannot take this step: {exc}") from exc
        if check:
            fail_on_nan([core_attn_out[0, :T]], self._kdaserve_nan_out)
        return True
