"""Device launches per decode step, per decoder layer kind: what a CUDA graph of the step replays,
counted on a CPU.

Why: at small batches a decode step is latency-bound, and every kernel of the graph costs a few
microseconds beyond its work (docs/perf-notes.md has what launches cost Kimi-Linear's batch-1 step).

How: a tiny model of the family (default `kimi-tiny`) through the engine with the choices a GPU
makes, on the CPU with Triton's interpreter: Triton KDA (flash prefill, fused decode), MLA and
MoE kernels, the Triton RMSNorm and SwiGLU, the one-program MoE alignment (a decode step's slots
are below its threshold). One decode step of `--batch` sequences is recorded: every Triton launch
by kernel name, every torch op that runs a device kernel (views and allocations excluded), each
under the decoder layer that issued it. Layers of one kind (attention x MLP) launch the same
kernels at any size, so the per-kind counts times a released model's layer counts give its step.
One launch differs from CUDA's: the LM head's fp32 logits are a GEMM and a cast here, one GEMM
that writes fp32 on CUDA (layers/embed_head.py), so a CUDA step makes one launch fewer.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/decode_launches.py [--model kimi-tiny] [--batch 3] [--list]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run with TRITON_INTERPRET=1: the Triton kernels run through the interpreter on the CPU")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

# Torch ops that launch no kernel of their own: allocations and metadata.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "_local_scalar_dense", "lift_fresh", "detach", "alias", "set_",
              "resize_", "_to_copy_noop"}
DTYPE = "float16"   # a 2-byte dtype as served (bf16 cannot run through the interpreter): its casts are launches too
RELEASED = {"kimi-tiny": "moonshotai/Kimi-Linear-48B-A3B-Instruct", "glm-tiny": "zai-org/GLM-5.3-Flash"}


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = "step"
        self.launches: list[tuple[str, str]] = []   # (where, kernel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL and (not func.is_view or _new_storage(out, args)):
            self.launches.append((self.where, f"torch {name}"))
        return out


def _new_storage(out, args) -> bool:
    """Whether a view-like op (`to`, `reshape`, `contiguous`) made a copy: its output's memory is
    none of its inputs' (a cast or a gather of strided rows is a kernel; a true view is not)."""
    if not isinstance(out, torch.Tensor):
        return False
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return out.untyped_storage().data_ptr() not in inputs


def force_gpu_choices(model, monkeypatch_align) -> None:
    from kdaserve.layers.mlp import SwiGLUMLP
    from kdaserve.layers.norm import RMSNorm

    for m in model.modules():
        if isinstance(m, (RMSNorm, SwiGLUMLP)) and getattr(m, "backend", None) == "auto":   # older code: no SwiGLU choice
            m.backend = "triton"
    monkeypatch_align()


def layer_kind(layer) -> str:
    attention = "KDA" if layer.is_kda else "MLA"
    mlp = "MoE" if getattr(layer, "is_moe", False) else "dense MLP"
    return f"{attention} + {mlp}"


def record(model_name: str, batch: int) -> tuple[Recorder, dict[str, int], object]:
    import triton.runtime.interpreter as interpreter

    import kdaserve.ops.moe.align as align
    import kdaserve.ops.moe.fused as fused
    from kdaserve.engine import LLM, SamplingParams

    llm = LLM(model_name, kda_prefill_backend="flash", kda_decode_backend="fused", mla_backend="triton",
              moe_backend="triton", max_num_seqs=max(4, batch), max_model_len=64, dtype=DTYPE, enforce_eager=True)
    eng = llm.engine
    model = eng.runner.model
    original_align = align.align_to_experts

    def gpu_align():
        fused.align_to_experts = lambda ids, E, bm, path=None, **kw: original_align(ids, E, bm, path=path or "per_expert",
                                                                                  **kw)

    force_gpu_choices(model, gpu_align)
    for i in range(batch):
        eng.add_request(f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=50, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.requests.values()):
        eng.step()
    eng.step()   # a plain decode step before the recorded one

    rec = Recorder()
    layers = list(model.model.layers)
    kinds = {i: layer_kind(layer) for i, layer in enumerate(layers)}
    hooks = [layer.register_forward_pre_hook(lambda _m, _a, i=i: setattr(rec, "where", kinds[i])) for i, layer in
             enumerate(layers)]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda *_: setattr(rec, "where", "head (final norm, LM head, "
                                                                                             "sampling)")))
    run = interpreter.InterpretedFunction.run

    def launch(fn, *args, **kwargs):
        rec.launches.append((rec.where, f"triton {fn.fn.__name__}"))
        with _disable_current_modes():
            return run(fn, *args, **kwargs)

    interpreter.InterpretedFunction.run = launch
    try:
        with rec:
            rec.where = "step inputs, embedding"
            eng.step()
    finally:
        interpreter.InterpretedFunction.run = run
        for h in hooks:
            h.remove()
    return rec, Counter(kinds.values()), llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kimi-tiny", choices=sorted(RELEASED))
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--list", action="store_true", help="also every launch, in order")
    args = ap.parse_args()
    rec, layers_of_kind, _ = record(args.model, args.batch)
    per_place: dict[str, Counter] = defaultdict(Counter)
    for where, kernel in rec.launches:
        per_place[where][kernel] += 1
    if args.list:
        for where, kernel in rec.launches:
            print(f"{where:40s} {kernel}")

    from kdaserve.models.builtin import released_config

    released = released_config(RELEASED[args.model])
    released_kinds = Counter()
    for i, t in enumerate(released.layer_types):
        attention = "KDA" if t == "linear_attention" else "MLA"
        released_kinds[f"{attention} + {'MoE' if released.is_moe_layer(i) else 'dense MLP'}"] += 1

    print(f"\n{args.model}, one decode step of {args.batch} sequences, the launches a GPU makes (recorded on the CPU)")
    print(f"| where | launches per layer | kernels | layers in {args.model} | layers in {RELEASED[args.model]} | "
          f"launches in {RELEASED[args.model]} |")
    print("|---|---|---|---|---|---|")
    total_tiny = total_released = 0
    for where, counts in per_place.items():
        n_tiny = layers_of_kind.get(where, 1)
        n_rel = released_kinds.get(where, 1 if where in ("step inputs, embedding", "head (final norm, LM head, sampling)") else 0)
        per_layer = sum(counts.values()) / n_tiny
        kernels = ", ".join(f"{k.split(' ', 1)[1]} x{v // n_tiny}" if v // n_tiny > 1 else k.split(" ", 1)[1]
                            for k, v in counts.items())
        print(f"| {where} | {per_layer:g} | {kernels} | {n_tiny} | {n_rel} | {per_layer * n_rel:g} |")
        total_tiny += sum(counts.values())
        total_released += per_layer * n_rel
    missing = {k: n for k, n in released_kinds.items() if k not in layers_of_kind}
    bound = "at least " if missing else ""
    print(f"| total | - | - | {sum(layers_of_kind.values())} | {len(released.layer_types)} | {bound}{total_released:g} |")
    for kind, n in missing.items():   # the tiny model has no layer of this kind: nothing to count it by
        print(f"{RELEASED[args.model]} has {n} layers of kind '{kind}', which {args.model} lacks: not counted")
    print(f"{args.model}: {total_tiny} launches per decode step; at {RELEASED[args.model]}'s layer counts: "
          f"{bound}{total_released:g}")


if __name__ == "__main__":
    main()
