"""Start-up compile in parallel (ops/compile_ahead.py): the switch that turns a thread's launches
into compiles and back, the decorated launcher's two passes, and on the GPU that the first pass
writes nothing and the second gives the same results as a plain call."""

from __future__ import annotations

import threading

import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

from kdaserve.ops import compile_ahead
from kdaserve.ops.compile_ahead import compile_only, compiles_ahead, warm_up_compiles, warming_up

cpu_only = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                              reason="CPU tests run in Triton's interpreter (TRITON_INTERPRET=1)")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or triton.knobs.runtime.interpret,
                         reason="needs a GPU without the interpreter")


@pytest.fixture
def recorded_runs(monkeypatch):
    """JITFunction.run replaced by a recorder of (thread, warmup) for each launch."""
    calls = []

    def run(self, *args, grid, warmup, **kwargs):
        calls.append((threading.current_thread().name, warmup))

    monkeypatch.setattr(JITFunction, "run", run)
    return calls


@pytest.fixture
def natively(monkeypatch):
    """As if Triton compiled for a GPU here (CI runs the interpreter), with several threads."""
    monkeypatch.setattr(compile_ahead, "_compiles_natively", lambda: True)
    monkeypatch.setattr(compile_ahead, "_capturing", lambda: False)
    monkeypatch.setenv(compile_ahead.COMPILE_THREADS_ENV, "4")


def test_compile_only_turns_this_threads_launches_into_compiles_and_restores_triton(recorded_runs):
    recorder = JITFunction.run
    launch = lambda: JITFunction.run(object.__new__(JITFunction), 1, grid=(1,), warmup=False)   # noqa: E731
    launch()
    other: list = []
    with compile_only():
        assert JITFunction.run is not recorder
        launch()
        t = threading.Thread(target=launch, name="other-thread")   # not switched: its own context
        t.start()
        t.join()
        other = recorded_runs[-1]
    assert JITFunction.run is recorder, "Triton's class must be restored when the last pass ends"
    launch()
    assert [w for _, w in recorded_runs] == [False, True, False, False]
    assert other == ("other-thread", False)


def test_nested_compile_only_patches_once(recorded_runs):
    recorder = JITFunction.run
    with compile_only():
        patched = JITFunction.run
        with compile_only():
            assert JITFunction.run is patched
        assert JITFunction.run is patched   # the outer pass still compiles
    assert JITFunction.run is recorder


def test_a_decorated_launcher_runs_a_compile_pass_first_only_while_warming_up(natively):
    passes = []

    @compiles_ahead
    def launcher(x):
        passes.append(compile_ahead._compile_only.get())
        return x + 1

    assert launcher(1) == 2 and passes == [False]            # serving: one plain call
    passes.clear()
    with warm_up_compiles():
        assert warming_up()
        assert launcher(1) == 2
    assert passes == [True, False], "compile pass, then the real one"
    assert not warming_up()


def test_nested_launchers_compile_in_the_outer_pass(natively):
    passes = []

    @compiles_ahead
    def inner():
        passes.append(("inner", compile_ahead._compile_only.get()))

    @compiles_ahead
    def outer():
        passes.append(("outer", compile_ahead._compile_only.get()))
        inner()

    with warm_up_compiles():
        outer()
    assert passes == [("outer", True), ("inner", True), ("outer", False), ("inner", False)]


@pytest.mark.parametrize("reason", ["one thread", "interpreter", "graph capture"])
def test_no_compile_pass_where_it_cannot_help_or_would_harm(natively, monkeypatch, reason):
    if reason == "one thread":
        monkeypatch.setenv(compile_ahead.COMPILE_THREADS_ENV, "1")
    elif reason == "interpreter":
        monkeypatch.setattr(compile_ahead, "_compiles_natively", lambda: False)
    else:   # a first pass's torch ops would be captured into the graph
        monkeypatch.setattr(compile_ahead, "_capturing", lambda: True)
    passes = []

    @compiles_ahead
    def launcher():
        passes.append(compile_ahead._compile_only.get())

    with warm_up_compiles():
        launcher()
    assert passes == [False]


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_thread_count_says_what_is_expected(monkeypatch, value):
    monkeypatch.setenv(compile_ahead.COMPILE_THREADS_ENV, value)
    with pytest.raises(ValueError, match=r"KDASERVE_COMPILE_THREADS must be a whole number of threads >= 1"):
        compile_ahead.compile_workers()


def test_thread_count_defaults_to_the_usable_cores(monkeypatch):
    monkeypatch.delenv(compile_ahead.COMPILE_THREADS_ENV, raising=False)
    assert 1 <= compile_ahead.compile_workers() <= 32


@cpu_only
@pytest.mark.parametrize("gate, lens, segment_len, dtype, sibling_chunk", [
    ("bounded", [40, 1, 17], 0, torch.float32, 32),
    ("unbounded", [40, 1, 17], 0, torch.float16, 32),   # 16-bit: the segmented path's 32-token chunks
    ("unbounded", [40, 1, 17], 0, torch.float32, 16),   # fp32: nested factors, 16-token chunks throughout
    ("unbounded", [70, 5], 32, torch.float16, 16),
    ("bounded", [3], 32, torch.float32, 32)])
def test_flash_compile_pass_takes_the_other_path_too(gate, lens, segment_len, dtype, sibling_chunk, monkeypatch):
    """The compile pass's sibling (the path the step did not take) is built and run, once, for
    the first sequence. Here through the interpreter, where kernels run (nothing compiles), so
    only its plumbing is checked; on the GPU the test below checks what it compiles."""
    from kdaserve.ops.kda.flash import kda_prefill_flash
    from kdaserve.ops.kda.flash.prefill import FlashPrefill
    from kdaserve.testing import make_kda_case

    plans = []
    prepare = FlashPrefill.prepare

    def spy(self):
        plans.append((self.plan.segmented, self.C, self.T))
        return prepare(self)

    monkeypatch.setattr(FlashPrefill, "prepare", spy)
    case = make_kda_case(lens, H=2, D=16, gate=gate, dtype=dtype, seed=3)
    token = compile_ahead._compile_only.set(True)
    try:
        kda_prefill_flash(out=case.new_out(), **case.prefill_args(), segment_len=segment_len)
    finally:
        compile_ahead._compile_only.reset(token)
    segmented = bool(segment_len)
    assert plans[0][0] == segmented and len(plans) == 2
    assert plans[1] == (not segmented, sibling_chunk, lens[0])


# ------------------------------------------------------------------------------------------ GPU

def _compiled_variants() -> int:
    from kdaserve.ops.kda.flash.correct import flash_correct_kernel
    from kdaserve.ops.kda.flash.prepare import flash_prepare_kernel
    from kdaserve.ops.kda.flash.recurrence import flash_recurrence_kernel
    from kdaserve.ops.kda.flash.scan import flash_scan_kernel

    dev = torch.cuda.current_device()
    return sum(len(k.device_caches[dev][0]) for k in (flash_prepare_kernel, flash_recurrence_kernel, flash_scan_kernel,
                                                      flash_correct_kernel))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gpu_flash_compile_pass_writes_nothing_and_compiles_the_segmented_path_too(gate, monkeypatch):
    """H = 3, D = 64: specializations no other test compiles, so the passes really compile. A
    step of short sequences while warming up compiles the segmented kernels too (with the
    unbounded gate: 32-token chunks): a later long sequence, which flash segments, compiles
    nothing more."""
    from kdaserve.ops.kda.flash import flash_step_plan, kda_prefill_flash
    from kdaserve.testing import make_kda_case, tolerance_for
    from kdaserve.testing.properties import check_prefill_matches_reference

    monkeypatch.setenv(compile_ahead.COMPILE_THREADS_ENV, "8")
    tol = tolerance_for(torch.bfloat16)
    kw = dict(H=3, D=64, device="cuda", dtype=torch.bfloat16, conv_dtype=torch.bfloat16, gate=gate)
    case = make_kda_case([100, 1, 77, 33], seed=21, **kw)
    before = case.recurrent_state.clone(), case.conv_state.clone()
    out = case.new_out()
    with compile_only():
        kda_prefill_flash(out=out, **case.prefill_args())
    torch.cuda.synchronize()
    assert out.isnan().all(), "the compile pass launched a kernel"
    assert torch.equal(case.recurrent_state, before[0]) and torch.equal(case.conv_state, before[1])
    with warm_up_compiles():
        check_prefill_matches_reference(kda_prefill_flash, case, tol)
    compiled = _compiled_variants()
    long = make_kda_case([4096], seed=22, **kw)
    assert flash_step_plan(long.cu_seqlens, long.cu_seqlens_cpu, 4096, 3, 64, gate == "bounded").plan.segmented
    check_prefill_matches_reference(kda_prefill_flash, long, tol, chunk_size=64)   # segmented: 3 chains
    assert _compiled_variants() == compiled, "the segmented path compiled after the warm-up"


@pytest.mark.gpu
@gpu
def test_gpu_fused_moe_while_warming_up_equals_a_plain_call(monkeypatch):
    from kdaserve.ops.moe import RouterConfig, route_tokens
    from kdaserve.ops.moe.fused import moe_experts_fused

    monkeypatch.setenv(compile_ahead.COMPILE_THREADS_ENV, "8")
    E, k, hidden, inter, T = 32, 4, 320, 192, 300   # sizes no other test compiles
    g = torch.Generator(device="cuda").manual_seed(5)
    w13 = (torch.randn(E, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(E, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    x = torch.randn(T, hidden, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, hidden, device="cuda", generator=g) * hidden**-0.5
    weights, ids = route_tokens(x, gate, None, RouterConfig(E, k))
    with warm_up_compiles():
        warm = moe_experts_fused(x, w13, w2, weights, ids)
    assert torch.equal(warm, moe_experts_fused(x, w13, w2, weights, ids))
