"""Host (Python) cost of one prefill call, with every Triton launch stubbed out: runs on a CPU.

Why: a serving engine calls prefill once per KDA layer per step (48+ layers) without CUDA graphs,
so every 100 µs of Python per call is ~5 ms per step during which a short prompt's GPU waits.

How: each `kernel[grid](...)` records its grid and returns, so only the wrappers run (Triton's own
launcher is left out, except for the `+bind` column, which adds its argument binding and cache key
for an sm_90 target: the Python part of JITFunction.run on a warm cache). Device tensors live on
torch's meta device: shapes and strides without memory, allocations about as cheap as CUDA's
caching allocator, and a host table sent to the device is a real, countable copy. Only
cu_seqlens_cpu holds values.

Columns per (shape, backend): µs per call with one step repeated (layers 2..48 of a step: each
call takes the step's plan, built once), the same plus Triton's binding, µs of the plan and the
first call on a new step (the first layer), and per call: kernel launches, device ops
(allocations, copies, small kernels: each is a CUDA API call on a GPU host) and host->device copies.

    PYTHONPATH=$PWD python3 benchmarks/host_overhead.py            # the table (~1 min)
    PYTHONPATH=$PWD python3 benchmarks/host_overhead.py --profile flash:4x64   # cProfile of one column
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import time

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("unset TRITON_INTERPRET: this times the wrappers with launches stubbed, not the interpreter")

import torch
import triton.runtime.jit as triton_jit
from torch.utils._python_dispatch import TorchDispatchMode

from kdaserve.backends import planners
from kdaserve.backends.requirements import LayerSettings
from kdaserve.ops.kda.conv import causal_conv_varlen_fwd
from kdaserve.ops.kda.flash import kda_prefill_flash
from kdaserve.ops.kda.types import KDACache, KDAInputs, KDAWeights, PrefillSeqs

DEVICE = torch.device("meta")
SHAPES = ("1x64", "4x64", "16x1024", "1x65536")
NEW_STEPS = 24
LAUNCHES: list = []
BIND = False  # also run Triton's argument binding in each stubbed launch


def stub_launches() -> None:
    """Every `kernel[grid](...)` appends (kernel name, grid) to LAUNCHES and returns; with BIND on
    it first runs what Triton's JITFunction.run does before its C launcher on a warm cache (the
    argument binder that computes the specialization, and the cache key), for an sm_90 target."""

    def getitem(self, grid):
        def launch(*args, **kwargs):
            if BIND:
                binder, key_cache = _binder(self)
                _, spec, options = binder(*args, debug=False, instrumentation_mode="", **kwargs)
                triton_jit.compute_cache_key(key_cache, spec, options)
            LAUNCHES.append((getattr(self, "__name__", "?"), grid))

        return launch

    triton_jit.KernelInterface.__getitem__ = getitem


@functools.cache
def _binder(kernel):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    return triton_jit.create_function_from_signature(kernel.signature, kernel.params, backend), {}


class CountDeviceOps(TorchDispatchMode):
    """Counts torch ops that touch the device (every one is a CUDA API call on a GPU host:
    an allocation, a small kernel or a copy) and, among them, host->device copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.h2d = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        tensors = [t for t in (*args, *kwargs.values(), result) if isinstance(t, torch.Tensor)]
        if any(t.device == DEVICE for t in tensors):
            self.ops += not func.is_view  # views cost no CUDA call
            self.h2d += any(t.device.type == "cpu" for t in tensors)
        return result


def metadata_step(seq_lens: list[int], H: int = 32, D: int = 128, dtype=torch.bfloat16) -> dict:
    """Prefill arguments shaped like a real step, device tensors on the meta device (shapes and
    strides without memory, allocations that cost about what CUDA's caching allocator costs);
    only cu_seqlens_cpu is a real host tensor."""
    N, T, P = len(seq_lens), sum(seq_lens), H * D
    empty = functools.partial(torch.empty, device=DEVICE)
    proj = empty(T, 3 * P + H, dtype=dtype)
    act = empty(T, H, D, dtype=dtype)
    weights = KDAWeights(
        conv_weight=empty(3 * P, 4), A_log=empty(H), dt_bias=empty(H, D), norm_weight=empty(D), lower_bound=-5.0,
    )
    cu = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        inputs=KDAInputs(proj[:, : 3 * P], act, proj[:, 3 * P :], act), weights=weights,
        cache=KDACache(empty(N + 1, 3, 3 * P, dtype=dtype), empty(N + 1, H, D, D)),
        seqs=PrefillSeqs(cu.to(DEVICE), empty(N, dtype=torch.int32), empty(N, dtype=torch.bool), cu), out=act,
    )


def conv_only(inputs, weights, cache, seqs, out, step_plan=None):
    causal_conv_varlen_fwd(inputs.qkv, weights.conv_weight, cache.conv_state, seqs.cu_seqlens, seqs.state_indices,
                           seqs.has_initial_state, cache.conv_layout, cu_seqlens_cpu=seqs.cu_seqlens_cpu, out=inputs.qkv,
                           tables=step_plan)


def planned(fn, planner):
    """A layer's call as the engine makes it: the step's plan is built on the step's first call (the
    runner builds it before the first layer) and every call of that step takes it."""
    plans: dict[int, object] = {}

    def call(**step):
        seqs, w, qkv = step["seqs"], step["weights"], step["inputs"].qkv
        key = id(seqs.cu_seqlens_cpu)  # one plan per step (the steps stay alive for the whole run)
        if key not in plans:
            settings = LayerSettings(input_dtype=qkv.dtype, head_dim=w.head_dim, lower_bound=w.lower_bound)
            plans[key] = planner(seqs.cu_seqlens, seqs.cu_seqlens_cpu, qkv.shape[0], w.num_heads, settings)
        fn(**step, step_plan=plans[key])

    return call


COLUMNS = {"flash": planned(kda_prefill_flash, planners.flash_plan),
           "conv": planned(conv_only, planners.conv_tables)}


def distinct_steps(shape: str, count: int) -> list[dict]:
    """`count` steps of about the shape, each with other lengths (step i: its first sequence i tokens
    shorter), so every host table, plan and memo keyed on the lengths misses on each of them."""
    n, length = (int(x) for x in shape.split("x"))
    return [metadata_step([length - i] + [length] * (n - 1)) for i in range(count)]


def us_per_call(fn, step: dict, calls: int, rounds: int = 7) -> float:
    """One step repeated: median over rounds of the mean µs per call (the CPU is shared)."""
    fn(**step)  # warm: the real run has compiled kernels and filled caches by then
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(max(calls // rounds, 1)):
            fn(**step)
        means.append((time.perf_counter() - t0) / max(calls // rounds, 1) * 1e6)
    return statistics.median(means)


def us_first_call(fn, steps: list[dict]) -> float:
    """Median µs of the first call on each of several new steps (the first layer of a step)."""
    times = []
    for step in steps:
        t0 = time.perf_counter()
        fn(**step)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def counts(fn, step: dict) -> tuple[int, int, int]:
    """(launches, device ops, host->device copies) of one call on `step`."""
    LAUNCHES.clear()
    with CountDeviceOps() as mode:
        fn(**step)
    return len(LAUNCHES), mode.ops, mode.h2d


def table(calls: int) -> None:
    global BIND
    print(f"Host µs per prefill call with every Triton launch stubbed (CPU, {torch.get_num_threads()} torch threads; "
          "H=32, D=128, bf16; device tensors on the meta device). same: one step repeated (layers 2..48 of a "
          "step), median of 7 rounds; +bind: plus Triton's argument binding and cache key per launch (the "
          "Python part of JITFunction.run, sm_90 target); new: first call on a new step (every cache misses: "
          f"layer 1), median of {NEW_STEPS} steps. Counts per call, 'same / new': kernel launches, device ops "
          "(allocations, copies, small kernels: each a CUDA API call on a GPU host), host->device copies.")
    print("| shape | backend | same µs | same+bind µs | new µs | launches | device ops | h2d copies |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        a, *fresh = distinct_steps(shape, 2 + NEW_STEPS)
        for name, fn in COLUMNS.items():
            fn(**a)  # module state a first-ever call sets up (not the cost of any later step)
            cold = counts(fn, fresh[-1])
            new = us_first_call(fn, fresh[:-1])
            same = us_per_call(fn, a, calls)
            BIND = True
            bind = us_per_call(fn, a, calls)
            BIND = False
            warm = counts(fn, a)
            cells = " | ".join(f"{w} / {c}" for w, c in zip(warm, cold))
            print(f"| {shape} | {name} | {same:.0f} | {bind:.0f} | {new:.0f} | {cells} |", flush=True)


def profile(spec: str, calls: int) -> None:
    column, shape = spec.split(":")
    fn, (a,) = COLUMNS[column], distinct_steps(shape, 1)
    fn(**a)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn(**a)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", metavar="COLUMN:NxL", help="cProfile one column at one shape instead of the table")
    args = ap.parse_args()
    stub_launches()
    if args.profile:
        profile(args.profile, args.calls)
    else:
        table(args.calls)


if __name__ == "__main__":
    main()
