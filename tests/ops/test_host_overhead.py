"""Host-side cost structure of the prefill entry points (no timing: benchmarks/host_overhead.py).

A serving engine calls prefill once per KDA layer per step with the same lengths, so whatever
depends only on the lengths (conv token blocks, the flash plan and segment choice) is
built once per step, as the step's plan, and handed to every layer: these tests pin the launches
and host->device copies of building a plan and of a layer's call with it, and that a step with
other lengths, even in the same host buffer, never gets stale tables.
Kernels are stubbed (each `kernel[grid](...)` is recorded, not run) unless a test needs real tables;
activations live on the meta device (shapes and strides, no memory)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import triton.runtime.jit as triton_jit
from torch.utils._python_dispatch import TorchDispatchMode

from kdaserve.ops.kda import checks
from kdaserve.ops.kda.checks import check_cu_seqlens_cpu
from kdaserve.ops.kda.conv import causal_conv_varlen_fwd, conv_step_tables
from kdaserve.ops.kda.conv.varlen import BLOCK_T, token_block_table
from kdaserve.ops.kda.flash import DEFAULT_CONFIG, flash_step_plan, kda_prefill_flash
from kdaserve.ops.kda.flash.plan import build_plan
from kdaserve.ops.kda.flash.prefill import FlashPrefill
from kdaserve.ops.kda.host_tables import host_offsets, tables_to_device
from kdaserve.ops.kda.types import KDACache, KDAInputs, KDAWeights, PrefillSeqs
from kdaserve.testing import make_kda_case

META = torch.device("meta")


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch as (kernel name, grid, args); the kernel does not run."""
    log = []

    def getitem(kernel, grid):
        return lambda *args, **kwargs: log.append((kernel.__name__, grid, args))

    monkeypatch.setattr(triton_jit.KernelInterface, "__getitem__", getitem)
    return log


class HostToDevice(TorchDispatchMode):
    """Counts ops that take a host tensor and give a device (here: meta) one."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        srcs = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
        if srcs and isinstance(result, torch.Tensor) and result.device != srcs[0].device:
            self.copies.append(srcs[0])
        return result


def meta_step(seq_lens, H=4, D=16, dtype=torch.bfloat16, cu_seqlens_cpu=None):
    """Prefill arguments with every device tensor on the meta device; only the host copy is real."""
    N, T, P = len(seq_lens), sum(seq_lens), H * D
    proj = torch.empty(T, 3 * P + H, dtype=dtype, device=META)
    act = torch.empty(T, H, D, dtype=dtype, device=META)
    w = KDAWeights(conv_weight=torch.empty(3 * P, 4, device=META), A_log=torch.empty(H, device=META),
                   dt_bias=torch.empty(H, D, device=META), norm_weight=torch.empty(D, device=META))
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32)
    return dict(inputs=KDAInputs(proj[:, : 3 * P], act, proj[:, 3 * P :], act), weights=w,
                cache=KDACache(torch.empty(N + 1, 3, 3 * P, dtype=dtype, device=META),
                               torch.empty(N + 1, H, D, D, device=META)),
                seqs=PrefillSeqs(torch.empty(N + 1, dtype=torch.int32, device=META),
                                 torch.empty(N, dtype=torch.int32, device=META),
                                 torch.empty(N, dtype=torch.bool, device=META), cu),
                out=act)


def conv_only(inputs, weights, cache, seqs, out, step_plan=None):
    causal_conv_varlen_fwd(inputs.qkv, weights.conv_weight, cache.conv_state, seqs.cu_seqlens, seqs.state_indices,
                           seqs.has_initial_state, cache.conv_layout, cu_seqlens_cpu=seqs.cu_seqlens_cpu, out=inputs.qkv,
                           tables=step_plan)


def plan_conv(step):
    return conv_step_tables(host_offsets(step["seqs"].cu_seqlens_cpu), META)


def plan_flash(step, **kw):
    H, D, seqs = step["weights"].num_heads, step["weights"].head_dim, step["seqs"]
    return flash_step_plan(seqs.cu_seqlens, seqs.cu_seqlens_cpu, step["inputs"].qkv.shape[0], H, D, True, **kw)


def plan_cost(planner, step, launches):
    """(kernel names launched, host->device copies, the plan) of building a step's plan."""
    launches.clear()
    with HostToDevice() as h2d:
        plan = planner(step)
    return [name for name, _, _ in launches], len(h2d.copies), plan


def per_call(fn, step, launches):
    """(kernel names launched, host->device copies) of one call."""
    launches.clear()
    with HostToDevice() as h2d:
        fn(**step)
    return [name for name, _, _ in launches], len(h2d.copies)


@pytest.mark.parametrize(
    "fn, planner, plan_launches, plan_copies, work",
    [
        (conv_only, plan_conv, [], 1, ["conv_varlen_out_kernel", "conv_varlen_state_kernel"]),
        (kda_prefill_flash, plan_flash, ["flash_plan_kernel"], 0,
         ["flash_prepare_kernel", "flash_prepare_kernel", "flash_recurrence_kernel"]),
    ],
    ids=["conv", "flash"],
)
def test_a_step_plan_is_built_once_and_every_layer_only_launches_its_work(launches, fn, planner, plan_launches,
                                                                           plan_copies, work):
    """Building the plan costs the tables' one pinned copy (conv) or the plan launch (flash);
    each layer's call with it launches the work only and copies nothing. Without a plan a call
    builds its own (tests, tools), at the plan's cost again."""
    step = meta_step([3, 104, 1])
    names, copies, plan = plan_cost(planner, step, launches)
    assert (names, copies) == (plan_launches, plan_copies)
    for _ in range(2):
        assert per_call(lambda **a: fn(**a, step_plan=plan), step, launches) == (work, 0)
    assert per_call(fn, step, launches) == (plan_launches + work, plan_copies)


def test_segmented_flash_plan_carries_its_segment_choice(launches):
    step = meta_step([300, 7])
    work = ["flash_prepare_kernel", "flash_prepare_kernel", "flash_recurrence_kernel", "flash_scan_kernel",
            "flash_correct_kernel"]
    names, _, plan = plan_cost(lambda st: plan_flash(st, segment_len=64), step, launches)
    assert names == ["flash_plan_kernel"] and plan.plan.segmented
    assert per_call(lambda **a: kda_prefill_flash(**a, step_plan=plan), step, launches)[0] == work


def _launch_args(launches, name):
    return next(args for n, _, args in reversed(launches) if n == name)


def test_conv_tables_follow_a_host_buffer_refilled_in_place(launches):
    """Engines refill one cu_seqlens_cpu buffer every step: same tensor, same N and T, other
    lengths. The same grid sizes, so only the tables' contents tell a stale cache apart."""
    cu = torch.tensor([0, 40, 64], dtype=torch.int32)
    for lens in ([40, 24], [24, 40], [40, 24]):
        cu[1] = lens[0]  # in place
        case = make_kda_case(lens, H=1, D=16, seed=3)
        case.cu_seqlens_cpu = cu
        conv_only(out=case.new_out(), **case.prefill_args())
        seq, t0 = token_block_table(cu, BLOCK_T)
        out_args = _launch_args(launches, "conv_varlen_out_kernel")
        assert torch.equal(out_args[13], seq) and torch.equal(out_args[14], t0), f"stale conv blocks for {lens}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the plan kernel on CPU tensors: interpreter only")
def test_flash_plan_follows_a_host_buffer_refilled_in_place():
    """The cached plan (built by the plan kernel in the interpreter) equals a fresh build_plan for
    each of three steps that share one host buffer, including a return to the first lengths."""
    cu = torch.tensor([0, 0, 77], dtype=torch.int32)
    for first in (50, 27, 50):
        cu[1] = first
        case = make_kda_case([first, 77 - first], H=1, D=16, seed=4)
        case.cu_seqlens_cpu = cu
        step = FlashPrefill(out=case.new_out(), **case.prefill_args())
        fresh = build_plan(case.cu_seqlens, 77, 2, step.C, None, cu.clone())
        for name in ("chunk_seq", "chunk_tok", "seg_seq", "seg_tok", "seg_end", "seg_chunk", "seq_seg0"):
            assert torch.equal(getattr(step.plan, name), getattr(fresh, name)), f"stale plan {name} for {first}"
        assert step.longest == max(first, 77 - first)


def test_flash_follows_the_config_it_is_given(launches):
    """A config is a value passed in (DEFAULT_CONFIG is frozen): the chunk size decides the grid,
    a cost-model field the segmentation."""
    grids = {}
    for chunk in (32, 16):
        config = dataclasses.replace(DEFAULT_CONFIG, chunk=chunk)
        names, _ = per_call(lambda **a: kda_prefill_flash(**a, config=config), meta_step([90, 5]), launches)
        assert names[0] == "flash_plan_kernel"
        grids[chunk] = next(grid for n, grid, _ in launches if n == "flash_prepare_kernel")
    assert grids == {32: (4 * 4,), 16: (7 * 4,)}  # 3 + 1 chunks of 32 vs 6 + 1 of 16, x 4 heads
    long_step = meta_step([8192 + 3])
    assert "flash_scan_kernel" in per_call(kda_prefill_flash, long_step, launches)[0]  # one sequence: segmented
    never = dataclasses.replace(DEFAULT_CONFIG, seg_min_len=1 << 30)
    assert "flash_scan_kernel" not in per_call(lambda **a: kda_prefill_flash(**a, config=never), long_step, launches)[0]


def test_order_check_memo_never_passes_a_different_copy():
    """The O(N) order scan is skipped only for the copy validated last; a decreasing copy of the
    same length right after a valid one must still fail."""
    check_cu_seqlens_cpu(torch.tensor([0, 3, 5, 9], dtype=torch.int32), 3, 9)
    with pytest.raises(ValueError, match="without decreasing"):
        check_cu_seqlens_cpu(torch.tensor([0, 6, 5, 9], dtype=torch.int32), 3, 9)
    assert checks._last_valid_offsets == (0, 3, 5, 9)
    with pytest.raises(ValueError, match="to T = 8"):
        check_cu_seqlens_cpu(torch.tensor([0, 3, 5, 9], dtype=torch.int32), 3, 8)  # memoized copy, other T


def test_packed_tables_are_aligned_copies():
    """One buffer for several tables: each view 128-byte aligned in it, none aliasing the host arrays."""
    a, empty, b = np.arange(5, dtype=np.int32), np.zeros(0, dtype=np.int32), np.arange(40, dtype=np.int32)
    ta, te, tb = tables_to_device([a, empty, b], torch.device("cpu"))
    a[0] = b[0] = 99
    assert ta.tolist() == list(range(5)) and te.numel() == 0 and tb.tolist() == list(range(40))
    assert ta.untyped_storage().data_ptr() == tb.untyped_storage().data_ptr()  # one copy
    assert [t.storage_offset() % 32 for t in (ta, te, tb)] == [0, 0, 0]


@pytest.mark.gpu
def test_gpu_host_tables_are_copied_from_pinned_memory():
    """cudaMemcpyAsync from pageable memory may synchronize with the stream: every host->device
    copy of a new step's tables must come from pinned memory."""
    sources = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.is_cuda:
                sources.extend(a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu")
            return result

    for fn in (conv_only, kda_prefill_flash):
        case = make_kda_case([37, 129, 4], H=2, D=64, dtype=torch.bfloat16, device="cuda", seed=5)
        with Record():
            fn(out=case.new_out(), **case.prefill_args())
    assert sources and all(s.is_pinned() for s in sources), [s.is_pinned() for s in sources]


def test_under_graph_capture_the_pinned_source_of_a_table_copy_is_kept(monkeypatch):
    """A captured host->device memcpy re-reads its source at every replay: under capture the
    source must outlive the call (the caching host allocator would hand a dropped pinned block
    to the next allocation)."""
    from kdaserve.ops.kda import host_tables

    monkeypatch.setattr(host_tables, "_CAPTURED_SOURCES", [])
    table = np.arange(7, dtype=np.int32)
    tables_to_device([table], torch.device("cpu"))
    assert host_tables._CAPTURED_SOURCES == []              # not capturing: nothing kept
    monkeypatch.setattr(host_tables, "capturing", lambda device: True)
    (view,) = tables_to_device([table], torch.device("cpu"))
    del view
    (kept,) = host_tables._CAPTURED_SOURCES
    assert kept[:7].tolist() == list(range(7))


@pytest.mark.gpu
def test_gpu_conv_captured_in_a_graph_replays_right_after_pinned_memory_is_recycled():
    """Conv prefill captured in a CUDA graph: its token-block table is copied from a pinned
    buffer by a captured memcpy. Fill many fresh pinned buffers of that size with garbage (what the
    allocator recycles freed blocks into), then replay: the output must equal the eager one."""
    case = make_kda_case([37, 129, 4], H=2, D=16, device="cuda", has_initial_state=False, seed=11)
    W = case.weights.conv_weight

    def conv(out):
        causal_conv_varlen_fwd(case.qkv, W, case.conv_state, case.cu_seqlens, case.state_indices,
                               case.has_initial_state, case.conv_layout, cu_seqlens_cpu=case.cu_seqlens_cpu, out=out)

    eager = torch.full_like(case.qkv, float("nan"))
    conv(eager)
    out = torch.full_like(case.qkv, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        conv(out)   # warm-up outside capture (compilation)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv(out)
    torch.cuda.synchronize()
    junk = [torch.full((n,), -7, dtype=torch.int32, pin_memory=True) for n in (64, 128, 256, 512) for _ in range(8)]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert junk and torch.equal(out, eager)


def test_a_plan_of_another_step_is_refused_before_any_write():
    """Tables built for other lengths (same sequence and token counts) would put each conv window
    in the wrong sequence: conv refuses them by value, as flash does its plan."""
    case = make_kda_case([40, 24], H=1, D=16, seed=6)
    other = conv_step_tables(host_offsets(torch.tensor([0, 24, 64], dtype=torch.int32)), torch.device("cpu"))
    rec, conv = case.recurrent_state.clone(), case.conv_state.clone()
    with pytest.raises(ValueError, match=r"lengths \(0, 24, 64\).*lengths \(0, 40, 64\)"):
        conv_only(out=case.new_out(), **case.prefill_args(), step_plan=other)
    assert torch.equal(case.recurrent_state, rec) and torch.equal(case.conv_state, conv)


@pytest.mark.parametrize("intra", ["clamped", "nested"])
def test_unbounded_gate_launches(launches, intra):
    """The unbounded gate's K1 launches like the bounded gate's, whichever intra-chunk factors:
    common chunks, then first chunks; nothing redone."""
    step = meta_step([3, 104, 1])
    step["weights"].lower_bound = None
    cfg = dataclasses.replace(DEFAULT_CONFIG, unbounded_intra=intra)
    H, D, seqs = step["weights"].num_heads, step["weights"].head_dim, step["seqs"]
    plan = flash_step_plan(seqs.cu_seqlens, seqs.cu_seqlens_cpu, step["inputs"].qkv.shape[0], H, D, False, config=cfg)
    names, _ = per_call(lambda **a: kda_prefill_flash(**a, step_plan=plan), step, launches)
    assert names == ["flash_prepare_kernel"] * 2 + ["flash_recurrence_kernel"]
