"""Every KDA backend by name: what it needs, and how to load it (only when selected).

Implementations are imported inside `load`, so this table works before a backend's module lands
and on machines without Triton, a GPU or the external packages.

Our Triton backends' requirements come from kdaserve/ops/kda/limits.py, the values their entry points
check at run time; the external adapters' are listed here, where their adapters live.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from kdaserve.backends import requirements as rq
from kdaserve.backends.requirements import Requirement
from kdaserve.ops.kda.limits import LOWER_BOUND_MIN

PHASES = ("prefill", "decode")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class BackendSpec:
    """A named implementation of one phase of the KDA core (calling convention of
    kdaserve.ops.kda.reference.kda)."""

    name: str
    phase: str
    summary: str
    load: Callable[[], Callable]                       # imports and returns the entry point
    requirements: Callable[[], tuple[Requirement, ...]]  # evaluated lazily, every one of them
    # Loader of a derived conv-weight layout `fn(conv_weight, out=None)` the layer must own and
    # refresh (passed to the kernel as KDAWeights.conv_weight_decode); None when not needed.
    conv_weight_decode_layout: Callable[[], Callable] | None = None
    graph_capturable: bool = True                      # decode: safe to capture in a CUDA graph
    # Prefill: loader of `plan(cu_seqlens, cu_seqlens_cpu, num_tokens, num_heads, settings) -> tables`,
    # what the backend prepares once per step (passed to every layer's call as `step_plan=`);
    # None: nothing to prepare.
    planner: Callable[[], Callable] | None = None
    # Prefill: takes prefix caching's state checkpoints (PrefillSeqs.checkpoints) inside the step;
    # otherwise the engine cuts prefill chunks at checkpoint boundaries and copies the states.
    takes_checkpoints: bool = False
    extra: dict = field(default_factory=dict)


def _fixed(*reqs: Requirement) -> Callable[[], tuple[Requirement, ...]]:
    return lambda: tuple(reqs)


def _op_limits(op: str, base: list[Requirement]) -> Callable[[], tuple[Requirement, ...]]:
    """`base` (platform, packages) and what kdaserve/ops/kda/limits.py says op `op` accepts: the values
    the op's own entry point checks, so the startup error and the runtime check cannot disagree.
    Read lazily; limits.py imports only torch, never the op package or Triton."""

    @functools.cache
    def reqs() -> tuple[Requirement, ...]:
        from kdaserve.ops.kda.limits import BY_OP, LOWER_BOUND_MIN

        lim = BY_OP[op]
        return tuple(base) + (
            rq.input_dtypes(*lim.input_dtypes), *(() if lim.bf16_in_interpreter else (rq.no_bf16_in_interpreter(),)),
            rq.head_dims(*lim.head_dims), rq.gates(*lim.gates), rq.lower_bound_range(LOWER_BOUND_MIN, 0.0),
            rq.state_dtypes(*lim.state_dtypes), rq.conv_layouts(*lim.conv_layouts),
            *((rq.conv_widths(*lim.conv_widths),) if lim.conv_widths else ()), rq.speculative(lim.speculative),
        )

    return reqs


def _requirements_of_all(phase: str, *names: str) -> Callable[[], tuple[Requirement, ...]]:
    """A backend that may call any of `names` needs what each of them needs (duplicates once)."""

    @functools.cache
    def reqs() -> tuple[Requirement, ...]:
        out: list[Requirement] = []
        for name in names:
            for r in _REGISTRY[phase][name].requirements():
                if not any(o.kind == r.kind and o.needs == r.needs for o in out):
                    out.append(r)
        return tuple(out)

    return reqs


def _attr(module: str, name: str) -> Callable[[], Callable]:
    def load() -> Callable:
        return getattr(importlib.import_module(module), name)

    return load


def _planner(name: str) -> Callable[[], Callable]:
    return _attr("kdaserve.backends.planners", name)


def _reference_prefill() -> Callable:
    from kdaserve.ops.kda.reference import kda_prefill_reference

    # The chunk-64 form equals the token loop (tests/ops/test_reference_kda.py) and is ~50x faster
    # on long prompts, which matters on the CPU.
    return functools.partial(kda_prefill_reference, chunk_size=64)


TRITON = [rq.platform("cuda", "rocm", triton_interpreter=True), rq.package("triton", "3.4")]
GPU_TRITON = [rq.platform("cuda", "rocm"), rq.package("triton", "3.4")]
ANY_GATE = rq.gates("bounded", "unbounded")
BOTH_LAYOUTS = rq.conv_layouts("SD", "DS")
FLA = [
    rq.package("fla", "0.6.0", hint="pip install fla-core==0.6.0"),
    rq.package("einops"),
    rq.implementation("kdaserve.ops.kda.conv"),  # our Triton conv: FLA's cannot read a paged conv pool
]
OUR_CONV = [rq.implementation("kdaserve.ops.kda.conv")]

_SPECS: list[BackendSpec] = [
    # ---- prefill -------------------------------------------------------------------------------
    BackendSpec("reference", "prefill", "torch reference (chunk-64 form), any device", _reference_prefill, _fixed(),
                graph_capturable=False, takes_checkpoints=True),
    BackendSpec(
        "flash", "prefill", "Triton, fused few-kernel chunked prefill", _attr("kdaserve.ops.kda.flash", "kda_prefill_flash"),
        _op_limits("flash", TRITON + [rq.implementation("kdaserve.ops.kda.flash")]), planner=_planner("flash_plan"),
        takes_checkpoints=True,
    ),
    BackendSpec(
        "fla", "prefill", "flash-linear-attention chunk_kda (+ our Triton conv, FLA's gated norm)",
        _attr("kdaserve.backends.adapters.fla", "kda_prefill_fla"),
        _fixed(*GPU_TRITON, *FLA, rq.input_dtypes(BF16, F16, F32), rq.head_dim_power_of_two(16, 256), ANY_GATE,
               rq.unrounded_gate(),
               rq.state_dtypes(F32, BF16), BOTH_LAYOUTS, rq.speculative(True)),
        planner=_planner("conv_tables"),
    ),
    BackendSpec(
        "flashkda", "prefill", "Moonshot AI FlashKDA (CUTLASS) + our Triton conv",
        _attr("kdaserve.backends.adapters.flashkda", "kda_prefill_flashkda"),
        _fixed(rq.platform("cuda"), rq.min_cuda_capability(9, 0), rq.package("flash_kda", hint="github.com/MoonshotAI/FlashKDA"),
               rq.package("triton", "3.4"), *OUR_CONV, rq.input_dtypes(BF16), rq.head_dims(128), rq.gates("bounded"),
               rq.unrounded_gate(),
               rq.lower_bound_range(LOWER_BOUND_MIN, 0.0), rq.state_dtypes(F32, BF16), BOTH_LAYOUTS, rq.speculative(True)),
        planner=_planner("conv_tables"),
    ),
    BackendSpec(
        "aiter", "prefill", "AMD AITER chunk_kda (Gluon, gfx950) + our Triton conv",
        _attr("kdaserve.backends.adapters.aiter", "kda_prefill_aiter"),
        _fixed(rq.platform("rocm"), rq.rocm_arch("gfx950"), rq.package("aiter"),
               rq.entry_points("aiter.ops.triton.attention.chunk_kda", hint="an AITER release with KDA prefill"),
               rq.package("triton", "3.4"), *OUR_CONV, rq.input_dtypes(BF16), rq.head_dims(128), rq.gates("bounded"),
               rq.unrounded_gate(),
               rq.lower_bound_range(LOWER_BOUND_MIN, 0.0), rq.state_dtypes(F32), BOTH_LAYOUTS, rq.speculative(True)),
        planner=_planner("conv_tables"),
    ),
    # ---- decode --------------------------------------------------------------------------------
    BackendSpec("reference", "decode", "torch reference (token loop), any device",
                _attr("kdaserve.ops.kda.reference", "kda_decode_reference"), _fixed(), graph_capturable=False),
    BackendSpec(
        "chain", "decode", "Triton, conv update -> recurrence -> gated norm (three launches)",
        _attr("kdaserve.ops.kda.chain", "kda_decode_chain"),
        _op_limits("chain", TRITON + [rq.implementation("kdaserve.ops.kda.chain")]),
    ),
    BackendSpec(
        "fused", "decode", "Triton, the whole decode step in one launch",
        _attr("kdaserve.ops.kda.fused", "kda_decode_fused"),
        _op_limits("fused", TRITON + [rq.implementation("kdaserve.ops.kda.fused")]),
        conv_weight_decode_layout=_attr("kdaserve.ops.kda.fused", "fused_conv_weight_layout"),
    ),
    BackendSpec(
        "adaptive", "decode",
        "Triton: `fused` for plain decode; speculative verify `fused` up to 512 head-steps, `chain` above (by shape, "
        "H200-measured)",
        _attr("kdaserve.ops.kda.adaptive", "kda_decode_adaptive"),
        _requirements_of_all("decode", "fused", "chain"),
        conv_weight_decode_layout=_attr("kdaserve.ops.kda.fused", "fused_conv_weight_layout"),
    ),
    BackendSpec(
        "fla", "decode", "flash-linear-attention fused_recurrent_kda (+ our Triton conv, FLA's gated norm)",
        _attr("kdaserve.backends.adapters.fla", "kda_decode_fla"),
        _fixed(*GPU_TRITON, *FLA, rq.input_dtypes(BF16, F16, F32), rq.head_dim_power_of_two(16, 256), ANY_GATE,
               rq.unrounded_gate(),
               rq.state_dtypes(F32, BF16), BOTH_LAYOUTS, rq.speculative(True)),
    ),
    BackendSpec(
        "aiter", "decode", "AMD AITER fused_recurrent_kda (Gluon, gfx950) + our Triton conv",
        _attr("kdaserve.backends.adapters.aiter", "kda_decode_aiter"),
        _fixed(rq.platform("rocm"), rq.rocm_arch("gfx950"), rq.package("aiter"),
               rq.entry_points("aiter.ops.triton.attention.kda", hint="an AITER release with KDA decode"),
               rq.package("triton", "3.4"), *OUR_CONV, rq.input_dtypes(BF16), rq.head_dims(128), ANY_GATE, rq.unrounded_gate(),
               rq.state_dtypes(F32), BOTH_LAYOUTS, rq.speculative(True)),
    ),
]

# Fastest first, per platform; `auto` takes the first eligible one. FLA is the baseline we beat;
# the reference always qualifies, so `auto` never fails.
AUTO_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {"prefill": ("flash", "fla", "reference"),
             "decode": ("adaptive", "fused", "chain", "fla", "reference")},
    "rocm": {"prefill": ("aiter", "flash", "fla", "reference"), "decode": ("aiter", "fused", "chain", "fla", "reference")},
    # On the CPU even with TRITON_INTERPRET=1: the interpreter is far slower than torch.
    "cpu": {"prefill": ("reference",), "decode": ("reference",)},
}

_REGISTRY: dict[str, dict[str, BackendSpec]] = {p: {} for p in PHASES}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) a backend: how tests and plugins add one without editing this table."""
    if spec.phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {spec.phase!r}")
    _REGISTRY[spec.phase][spec.name] = spec


def unregister_backend(phase: str, name: str) -> None:
    _REGISTRY[phase].pop(name, None)


def backend_names(phase: str) -> tuple[str, ...]:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return tuple(_REGISTRY[phase])


def get_spec(phase: str, name: str) -> BackendSpec | None:
    return _REGISTRY[phase].get(name)


for _spec in _SPECS:
    register_backend(_spec)

# The built-in names of each phase, from the table above ("auto" first): one list, never restated.
PREFILL_BACKENDS = ("auto", *(s.name for s in _SPECS if s.phase == "prefill"))
DECODE_BACKENDS = ("auto", *(s.name for s in _SPECS if s.phase == "decode"))
