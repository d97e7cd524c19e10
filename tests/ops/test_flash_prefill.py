"""The `flash` prefill backend against the fp64 reference, and the properties of the contract.

CPU: Triton's interpreter, fp32 (tolerance 1e-5) and fp16 (the 16-bit workspace path), tiny
shapes; the segmented (sequence-parallel) path is forced on with `segment_len`. GPU (marked): bf16
at real sizes, a 128K-token sequence with slow-decay heads (also marked slow), no host syncs.
"""

import dataclasses
import functools
import os

import pytest
import torch
import triton
from compiled_mode import run_compiled

from kdaserve.ops.kda.flash import flash_step_plan, kda_prefill_flash
from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG as CONFIG
from kdaserve.ops.kda.flash.plan import build_plan, choose_segment_len
from kdaserve.testing import assert_rel_close, make_kda_case, tolerance_for
from kdaserve.testing.properties import (
    check_mixed_equals_alone,
    check_prefill_matches_reference,
    check_split_prefill,
    run_prefill,
)

INTERPRET = bool(triton.knobs.runtime.interpret)
# 32-token chunks at LB = -5: entries above the diagonal of the anchored products may overflow to
# inf (numpy warns in the interpreter); they are discarded by a select (docs/flash-prefill.md).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in matmul", "ignore:invalid value encountered")
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests run in Triton's interpreter (TRITON_INTERPRET=1)")
gpu = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a GPU without the interpreter")

UNSEGMENTED = functools.partial(kda_prefill_flash, segment_len=0)
SEGMENTED = functools.partial(kda_prefill_flash, segment_len=16)  # one chunk per segment (rounded up to it)


def flash(segment_len, **config_changes):
    """flash with a forced segment choice and, optionally, a config other than the default."""
    return functools.partial(kda_prefill_flash, segment_len=segment_len,
                             config=dataclasses.replace(CONFIG, **config_changes))


def configured(fn, **config_changes):
    return functools.partial(fn, config=dataclasses.replace(CONFIG, **config_changes))


# ------------------------------------------------------------------------------------------ CPU


@cpu_only
@pytest.mark.parametrize("gate, layout, segment_len",
                         [("bounded", "SD", 0), ("bounded", "SD", 16), ("unbounded", "DS", 0), ("unbounded", "DS", 32)])
def test_matches_reference_fp32(gate, layout, segment_len):
    # Lengths: partial chunks, exactly one chunk, 1 token, several segments; a null slot.
    case = make_kda_case([5, 40, 1, 16, 37], H=2, D=16, gate=gate, conv_layout=layout, spec_tokens=1,
                         has_initial_state=[True, False, True, True, False], slow_decay_heads=1, seed=1)
    case.state_indices[3] = 0
    check_prefill_matches_reference(flash(segment_len), case, 1e-5)


@cpu_only
@pytest.mark.parametrize("segment_len", [0, 16])
def test_matches_reference_fp16_workspace(segment_len):
    """fp16 inputs take the GPU's path: 16-bit workspace and dot operands, fp32 state."""
    case = make_kda_case([33, 20], H=2, D=32, dtype=torch.float16, conv_dtype=torch.float16,
                         has_initial_state=[True, False], seed=2)
    check_prefill_matches_reference(flash(segment_len), case, tolerance_for(torch.float16))


@cpu_only
@pytest.mark.parametrize("half_dots", [True, False], ids=["half-dots", "tf32-dots"])
@pytest.mark.parametrize("gate, chunk", [("bounded", 32), ("unbounded", 16), ("unbounded", 32)])
def test_prepare_dot_operands_fp16_workspace(gate, chunk, half_dots):
    """K1's inverse, W and U~ products (and the joined halves' products, the unbounded gate at 32)
    on fp16 operands (prepare_half_dots, the default) or on fp32 ones at tf32, within the 16-bit
    tolerance of the fp64 reference."""
    case = make_kda_case([33, 20, 1, 70], H=2, D=32, gate=gate, dtype=torch.float16, conv_dtype=torch.float16,
                         has_initial_state=[True, False, True, True], slow_decay_heads=1, seed=2)
    fn = flash(0, prepare_half_dots=half_dots, unbounded_chunk=chunk)
    check_prefill_matches_reference(fn, case, tolerance_for(torch.float16))


@cpu_only
def test_bf16_state_pool():
    tol = tolerance_for(torch.float32, torch.bfloat16)
    for fn in (UNSEGMENTED, SEGMENTED):
        case = make_kda_case([21, 9], H=2, D=16, state_dtype=torch.bfloat16, has_initial_state=True, seed=3)
        check_prefill_matches_reference(fn, case, tol)


@cpu_only
def test_strong_decay_at_the_lower_bound():
    """Every gate at LB = -5: |g| reaches 80 inside a chunk, the edge of the anchored factors."""
    case = make_kda_case([40], H=1, D=16, has_initial_state=True, seed=4)
    case.forget_logits.fill_(30.0)
    check_prefill_matches_reference(UNSEGMENTED, case, 1e-5)


@cpu_only
@pytest.mark.parametrize("intra, chunk", [("nested", 16), ("nested", 32), ("clamped", 16), ("clamped", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_unbounded_gate(intra, chunk, dtype):
    """The unbounded gate's K1, every chunk in one pass: mixed decays with a slow-decay head, partial
    chunks and 1-token sequences. nested: exact for any decay, at both chunk sizes; fp16 takes fp16
    dot operands (every factor <= 1). clamped: one anchor per chunk (16) or per half chunk, joined
    (32), on a clamped decay with a 16-bit workspace; an fp32 workspace takes nested instead (so the
    fp32 cases are the nested pass again, by design). Most of these tokens' decays are clamped."""
    case = make_kda_case([5, 40, 1, 70], H=2, D=16, gate="unbounded", dtype=dtype, conv_dtype=dtype,
                         has_initial_state=[True, False, True, True], slow_decay_heads=1, seed=23)
    fn = configured(UNSEGMENTED, unbounded_intra=intra, unbounded_chunk=chunk)
    check_prefill_matches_reference(fn, case, 1e-5 if dtype == torch.float32 else tolerance_for(dtype))


@cpu_only
@pytest.mark.parametrize("intra, chunk, segment_len, dtype",
                         [("nested", 16, 0, torch.float32), ("nested", 16, 16, torch.float32),
                          ("nested", 32, 0, torch.float32), ("nested", 32, 32, torch.float32),
                          ("clamped", 16, 0, torch.float16), ("clamped", 16, 16, torch.float16),
                          ("clamped", 32, 0, torch.float16), ("clamped", 32, 32, torch.float16),
                          ("nested", 16, 0, torch.float16)],
                         ids=["nested", "nested-segmented", "nested-chunk32", "nested-chunk32-segmented",
                              "clamped-fp16", "clamped-fp16-segmented", "clamped-chunk32-fp16",
                              "clamped-chunk32-fp16-segmented", "nested-fp16"])
def test_unbounded_gate_with_huge_decay(intra, chunk, segment_len, dtype):
    """Decays far beyond fp32's exp range inside one chunk, so no single anchor could take them: the
    nested anchors are exact; the clamped pass (16-bit) keeps within its tolerance though nearly
    every token is clamped. Cumulative log-decays of hundreds cost fp32 cumsums ~1e-5 of relative
    precision in e^(g_t - g_i): the fp32 chunked reference (chunked.py) errs 1.1e-5 here, hence
    3e-5."""
    case = make_kda_case([20, 45], H=1, D=16, gate="unbounded", dtype=dtype, conv_dtype=dtype, has_initial_state=True,
                         seed=5)
    case.forget_logits.mul_(10.0)
    fn = configured(flash(segment_len), unbounded_intra=intra, unbounded_chunk=chunk)
    check_prefill_matches_reference(fn, case, 3e-5 if dtype == torch.float32 else tolerance_for(dtype))


def test_an_unknown_unbounded_config_is_refused():
    with pytest.raises(ValueError, match="unbounded_intra must be 'clamped' or 'nested', got 'halves'"):
        dataclasses.replace(CONFIG, unbounded_intra="halves")
    with pytest.raises(ValueError, match="unbounded_chunk must be 16 or 32, got 64"):
        dataclasses.replace(CONFIG, unbounded_chunk=64)
    with pytest.raises(ValueError, match="unbounded_segmented_chunk must be 16 or 32, got 8"):
        dataclasses.replace(CONFIG, unbounded_segmented_chunk=8)
    for clamp in (11.0, 0.0):
        with pytest.raises(ValueError, match=rf"unbounded_decay_clamp must be in \(0, 10.625\] \(one anchor spans 16 "
                                             rf"clamped tokens within e\^\(\+-85\)\), got {clamp}"):
            dataclasses.replace(CONFIG, unbounded_decay_clamp=clamp)


@cpu_only
@pytest.mark.parametrize("lens, H, chunk", [([8192], 32, 32), ([32768], 64, 32), ([1024] * 16, 32, 16), ([512] * 64, 32, 16)])
def test_unbounded_chunk_follows_segmentation(lens, H, chunk):
    """The unbounded gate's automatic plan: 32-token chunks (the joined halves) where flash would
    segment the step at 16, few long sequences (at 32 the cost model decides again whether to
    segment); 16 elsewhere, and for fp32 inputs (the nested K1). The bounded gate: its chunk
    always."""
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    plan = flash_step_plan(cu, cu, sum(lens), H, 128, False, config=CONFIG)
    assert plan.chunk == chunk and (chunk == 32 or not plan.plan.segmented)
    assert flash_step_plan(cu, cu, sum(lens), H, 128, True, config=CONFIG).chunk == CONFIG.chunk
    forced = flash_step_plan(cu, cu, sum(lens), H, 128, False, config=CONFIG, segment_len=1024)
    assert forced.chunk == CONFIG.unbounded_chunk and forced.plan.segmented
    fp32 = flash_step_plan(cu, cu, sum(lens), H, 128, False, config=CONFIG, input_dtype=torch.float32)
    assert fp32.chunk == CONFIG.unbounded_chunk


@cpu_only
@pytest.mark.parametrize("fn", [UNSEGMENTED, SEGMENTED], ids=["unsegmented", "segmented"])
def test_split_prefill_equals_whole(fn):
    check_split_prefill(fn, 45, 19, 1e-5, H=2, D=16, seed=6)


@cpu_only
def test_mixed_batch_equals_each_sequence_alone():
    check_mixed_equals_alone(SEGMENTED, [17, 1, 34, 3], 1e-5, H=2, D=16, seed=7)


@cpu_only
def test_segmented_equals_unsegmented_and_chunk_16_equals_32():
    case = make_kda_case([50, 12], H=2, D=16, has_initial_state=[True, False], slow_decay_heads=1, seed=8)
    a, b, c = case.clone(), case.clone(), case.clone()
    out_a = run_prefill(UNSEGMENTED, a)
    out_b = run_prefill(flash(32), b)
    other = 16 if CONFIG.chunk == 32 else 32
    out_c = run_prefill(flash(16, chunk=other), c)
    for out, x, what in ((out_b, b, "segments of 32"), (out_c, c, f"chunk {other}, segments of 16")):
        assert_rel_close(out, out_a, 1e-5, f"{what}: output")
        assert_rel_close(x.recurrent_state, a.recurrent_state, 1e-5, f"{what}: states")
        assert torch.equal(x.conv_state, a.conv_state)


@cpu_only
def test_plan_tables_without_host_copy():
    lens = [5, 0, 40, 16, 1]
    cu_cpu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T, N = int(cu_cpu[-1]), len(lens)
    exact = build_plan(cu_cpu, T, N, 16, 32, cu_cpu)
    bound = build_plan(cu_cpu, T, N, 16, 32, None)
    starts = cu_cpu.tolist()
    chunks = [(n, starts[n] + c) for n, ln in enumerate(lens) for c in range(0, ln, 16)]
    chunks_before = [sum(triton.cdiv(x, 16) for x in lens[:n]) for n in range(N)]
    segs = [(n, starts[n] + c, min(starts[n] + c + 32, starts[n] + ln), chunks_before[n] + c // 16)
            for n, ln in enumerate(lens) for c in (range(0, ln, 32) if ln else [0])]
    for plan in (exact, bound):
        assert plan.chunk_seq[: len(chunks)].tolist() == [n for n, _ in chunks]
        assert plan.chunk_tok[: len(chunks)].tolist() == [t for _, t in chunks]
        assert (plan.chunk_seq[len(chunks):] == -1).all()
        assert plan.seg_seq[: len(segs)].tolist() == [x[0] for x in segs]
        assert plan.seg_tok[: len(segs)].tolist() == [x[1] for x in segs]
        assert plan.seg_end[: len(segs)].tolist() == [x[2] for x in segs]
        assert plan.seg_chunk[: len(segs)].tolist() == [x[3] for x in segs]
        assert (plan.seg_seq[len(segs):] == -1).all()
        assert plan.seq_seg0.tolist() == [0, 1, 2, 4, 5, 6]
    assert exact.n_chunk_ids == len(chunks) and exact.n_seg_ids == len(segs)
    # Every table 128-byte aligned relative to the first (the kernels' pointer arguments keep the
    # 16-byte alignment Triton specializes on, whatever the counts: one compiled variant per step).
    for plan in (exact, bound):
        base = plan.chunk_seq.data_ptr()
        for t in (plan.chunk_tok, plan.seg_seq, plan.seg_tok, plan.seg_end, plan.seg_chunk, plan.seq_seg0):
            assert (t.data_ptr() - base) % 128 == 0, (plan.n_chunk_ids, plan.n_seg_ids)


@cpu_only
@pytest.mark.parametrize("host_cu", [True, False])
def test_conv_history_longer_than_a_chunk(host_cu):
    """Width 18 at 16-token chunks: the conv history reaches into each sequence's first two chunks,
    so the bounded gate's first-chunk launch runs two programs per (sequence, head) (NFIRST = 2)
    and the common launch skips both; sequences shorter than one and than two chunks included,
    with and without the host cu_seqlens (plan sizes then upper bounds)."""
    case = make_kda_case([5, 40, 1, 37, 17], H=2, D=16, conv_width=18, seed=22)
    chunk16 = configured(UNSEGMENTED, chunk=16)
    fn = chunk16 if host_cu else (lambda seqs, **a: chunk16(seqs=dataclasses.replace(seqs, cu_seqlens_cpu=None), **a))
    check_prefill_matches_reference(fn, case, 1e-5)


@cpu_only
def test_correction_grid_limit_is_a_clear_error_that_writes_nothing(monkeypatch):
    """Segments too long for the correction pass's grid (axis y, 65535 on CUDA; lowered here) are
    refused before any launch: the pools stay bit for bit, the output untouched."""
    import kdaserve.ops.kda.flash.prefill as flash_prefill

    monkeypatch.setattr(flash_prefill, "_MAX_GRID_Y", 1)
    case = make_kda_case([300, 40], H=2, D=16, seed=21)
    rec, conv = case.recurrent_state.clone(), case.conv_state.clone()
    out = case.new_out()
    with pytest.raises(ValueError, match="grid limit 1"):
        kda_prefill_flash(out=out, **case.prefill_args(), segment_len=512)
    assert torch.equal(case.recurrent_state, rec) and torch.equal(case.conv_state, conv)
    assert torch.isnan(out).all()


def test_segment_choice():
    cfg = CONFIG
    assert choose_segment_len(8192 * 8, 8, 64, 128, 16, None, 132, cfg) is None  # enough pairs
    assert choose_segment_len(512, 1, 16, 128, 16, None, 132, cfg) is None      # too short
    seg = choose_segment_len(32768, 1, 16, 128, 16, None, 132, cfg)
    assert seg is not None and seg % 16 == 0 and 1 < triton.cdiv(32768, seg) <= 16


def test_segment_choice_follows_the_config():
    """The choice is a function of the lengths and the config it is given, nothing else."""
    cu = torch.tensor([0, 30000, 32768], dtype=torch.int32)
    first = choose_segment_len(32768, 2, 16, 128, 32, cu, 132, CONFIG)
    assert first is not None and choose_segment_len(32768, 2, 16, 128, 32, cu, 132, CONFIG) == first
    never = dataclasses.replace(CONFIG, seg_min_len=1 << 30)
    assert choose_segment_len(32768, 2, 16, 128, 32, cu, 132, never) is None
    longer = dataclasses.replace(CONFIG, seg_min_tokens=first + 32)
    assert choose_segment_len(32768, 2, 16, 128, 32, cu, 132, longer) in (None, *range(first + 32, 32769))
    assert choose_segment_len(32768, 2, 16, 128, 32, cu, 132, CONFIG) == first


@cpu_only
def test_bad_inputs_raise_clear_errors():
    case = make_kda_case([4], H=1, D=16)
    with pytest.raises(ValueError, match="segment_len"):
        run_prefill(flash(-1), case)
    case = make_kda_case([4], H=1, D=8)
    with pytest.raises(ValueError, match="head sizes"):
        run_prefill(UNSEGMENTED, case)


@cpu_only
def test_k1_register_cap_per_gate(monkeypatch):
    """K1's cap (NVIDIA's compiler only), the same for both its launches: the bounded gate's
    prepare_maxnreg, the unbounded gate's unbounded_prepare_maxnreg (0: none)."""
    from kdaserve.ops.kda.flash.prefill import FlashPrefill

    def cap(case, **changes):
        prefill = FlashPrefill(case.inputs, case.weights, case.cache, case.prefill_seqs, case.new_out(),
                               config=dataclasses.replace(CONFIG, **changes))
        return prefill._prepare_maxnreg()

    bounded = make_kda_case([40, 7], H=2, D=16, seed=3)
    unbounded = make_kda_case([40, 7], H=2, D=16, seed=3, gate="unbounded")
    assert cap(bounded) == {}   # the interpreter refuses the option
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)   # as NVIDIA's build would see it
    assert cap(bounded) == {"maxnreg": 168} and cap(bounded, prepare_maxnreg=200) == {"maxnreg": 200}
    assert cap(unbounded) == {}
    assert cap(unbounded, unbounded_prepare_maxnreg=128) == {"maxnreg": 128}


def test_the_config_is_frozen_and_a_variant_is_a_new_value():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CONFIG.chunk = 16
    with pytest.raises(TypeError, match="bogus"):
        dataclasses.replace(CONFIG, bogus=1)


@cpu_only
def test_one_step_plan_serves_every_layer_and_refuses_another_step():
    """flash_step_plan is built once per step; every layer's call with it equals a call that plans
    for itself, and a plan of another step (other lengths, other heads) is a clear error."""
    from kdaserve.ops.kda.flash import flash_step_plan

    case = make_kda_case([40, 7, 33], H=2, D=16, has_initial_state=[True, False, True], seed=24)
    plan = flash_step_plan(case.cu_seqlens, case.cu_seqlens_cpu, sum(case.seq_lens), 2, 16, True)
    a, b = case.clone(), case.clone()
    out_a, out_b = run_prefill(kda_prefill_flash, a), run_prefill(functools.partial(kda_prefill_flash, step_plan=plan), b)
    assert torch.equal(out_a, out_b) and torch.equal(a.recurrent_state, b.recurrent_state)
    other = make_kda_case([40, 8, 32], H=2, D=16, seed=25)
    with pytest.raises(ValueError, match="built for another step"):
        run_prefill(functools.partial(kda_prefill_flash, step_plan=plan), other)
    wide = make_kda_case([40, 7, 33], H=4, D=16, seed=26)
    with pytest.raises(ValueError, match="built for another step"):
        run_prefill(functools.partial(kda_prefill_flash, step_plan=plan), wide)


@pytest.mark.skipif(os.environ.get("KDASERVE_COMPILE_CHECK") != "1", reason="minutes of CPU: set KDASERVE_COMPILE_CHECK=1")
def test_kernels_compile_for_sm90_without_a_gpu():
    """Compiled mode (not the interpreter) accepts every kernel, ptxas included."""
    run_compiled(["-m", "tools.compile_check_flash"], timeout=600)


# ------------------------------------------------------------------------------------------ GPU

BF16 = tolerance_for(torch.bfloat16)


def _gpu_case(seq_lens, H, **kw):
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("conv_dtype", torch.bfloat16)
    return make_kda_case(seq_lens, H=H, D=128, device="cuda", **kw)


def _ref_chunk(seq_lens):
    # The fp64 token loop is slow for long sequences on the GPU; the chunked reference is the
    # same math (tested equal to the loop to 1e-10 in test_reference_kda.py).
    return 64 if max(seq_lens) > 2048 else None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("segment_len", [None, 0, 256])
@pytest.mark.parametrize("gate, layout", [("bounded", "SD"), ("unbounded", "DS")])
def test_gpu_matches_reference(gate, layout, segment_len):
    lens = [1000, 1, 77, 2048, 16, 300]
    case = _gpu_case(lens, 4, gate=gate, conv_layout=layout, slow_decay_heads=1, seed=11,
                     has_initial_state=[True, False, True, False, True, True])
    case.state_indices[4] = 0
    check_prefill_matches_reference(flash(segment_len), case, BF16, chunk_size=_ref_chunk(lens))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("intra, chunk, segment_len", [("clamped", 16, 0), ("clamped", 32, 0), ("clamped", 16, 256),
                                                       ("clamped", 32, 256), ("nested", 16, None)])
def test_gpu_unbounded_gate(intra, chunk, segment_len):
    """The unbounded gate's K1 paths on the GPU (tf32 dots, fast exp, the register cap): bf16
    contract, mixed lengths, both chunk sizes, segmented or not, and the exact nested pass."""
    lens = [1000, 1, 77, 2048, 16, 300]
    case = _gpu_case(lens, 4, gate="unbounded", conv_layout="DS", slow_decay_heads=1, seed=16,
                     has_initial_state=[True, False, True, False, True, True])
    fn = flash(segment_len, unbounded_intra=intra, unbounded_chunk=chunk, unbounded_segmented_chunk=chunk)
    check_prefill_matches_reference(fn, case, BF16, chunk_size=_ref_chunk(lens))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("segment_len", [0, 1024])
def test_gpu_single_long_sequence_and_fp32_pool_bf16_pool(segment_len):
    for state_dtype in (torch.float32, torch.bfloat16):
        case = _gpu_case([8192], 2, state_dtype=state_dtype, slow_decay_heads=1, has_initial_state=True, seed=12)
        check_prefill_matches_reference(flash(segment_len), case, tolerance_for(torch.bfloat16, state_dtype), chunk_size=64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("segment_len", [0, 512])
def test_gpu_split_prefill_and_mixed_batch(segment_len):
    fn = flash(segment_len)
    check_split_prefill(fn, 3000, 1234, BF16, H=2, D=128, device="cuda", dtype=torch.bfloat16, seed=13)
    check_mixed_equals_alone(fn, [700, 1, 2100, 33], BF16, H=2, D=128, device="cuda", dtype=torch.bfloat16, seed=14)


@pytest.mark.gpu
@gpu
def test_gpu_no_host_sync_without_host_cu_seqlens():
    case = _gpu_case([3000, 500, 64], 4, seed=15)
    out = case.new_out()
    case.cu_seqlens_cpu = None
    args = case.prefill_args()
    for seg in (0, 512):
        kda_prefill_flash(out=out, **args, segment_len=seg)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kda_prefill_flash(out=out, **args, segment_len=seg)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@pytest.mark.parametrize("gate, segment_len", [("bounded", None), ("bounded", 0), ("unbounded", None)])
def test_gpu_128k_sequence_slow_decay_heads(gate, segment_len):
    """One 128K-token sequence, half the heads slow-decaying: precision must hold at full length
    (the unbounded gate: clamped, segmented, so in 32-token chunks of joined halves)."""
    case = _gpu_case([131072], 2, gate=gate, slow_decay_heads=1, has_initial_state=True, seed=16)
    check_prefill_matches_reference(flash(segment_len), case, BF16, chunk_size=64)


@cpu_only
@pytest.mark.parametrize("gate, layout, segment_len, chunk",
                         [("bounded", "SD", 0, 16), ("bounded", "DS", 0, 32), ("unbounded", "SD", 0, 16),
                          ("bounded", "SD", 32, 16), ("unbounded", "DS", 48, 16), ("unbounded", "DS", 32, 32)],
                         ids=["bounded", "bounded-C32-DS", "unbounded", "segmented", "segmented-unbounded",
                              "segmented-unbounded-C32"])
@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "in_loop"])   # NVIDIA's build, AMD's
def test_checkpoints_inside_the_launch(gate, layout, segment_len, chunk, pieces):
    if not pieces and chunk == 32 or not pieces and (gate, segment_len) == ("bounded", 32):
        pytest.skip("AMD's build (in_loop) on the 16-token chunk cases of each gate and segmentation: CI time")
    """Prefix caching's state checkpoints, written by the prefill launch itself: after the first
    chunk, in the middle, at the last chunk end before a partial chunk, for a sequence with and one
    without history; a third sequence takes none. Segmented, each kind of place: in the first
    segment (the map pass holds the true state), on a later segment's start (the scan's start
    state) and inside a later segment (the scan composes the map pass's partial maps): 16, 32 /
    48, 64 with 32-token segments; 16, 32 / 48 / 64 with 48-token ones; the sequence without
    history takes one inside its second segment too (48 of 60 with 32-token segments)."""
    from kdaserve.testing.properties import check_prefill_checkpoints

    case = make_kda_case([70, 60, 21], H=2, D=16, gate=gate, conv_layout=layout, spec_tokens=1,
                         has_initial_state=[True, False, True], extra_slots=8, seed=11)
    offsets = [[32, 64], [32], []] if chunk == 32 else [[16, 32, 48, 64], [16, 48], []]
    check_prefill_checkpoints(flash(segment_len if segment_len else 0, chunk=chunk, unbounded_chunk=chunk,
                                    checkpoint_pieces=pieces), case, offsets, 1e-5)


@gpu
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gpu_checkpoints_inside_the_launch(gate):
    """bf16 at real sizes (32 heads, D = 128) with the automatic plan: two sequences over few
    heads, so the step is segmented and the segments give way to checkpoints every 512 tokens."""
    from kdaserve.testing.properties import check_prefill_checkpoints

    case = make_kda_case([2100, 700], H=32, D=128, dtype=torch.bfloat16, conv_dtype=torch.bfloat16, gate=gate,
                         device="cuda", has_initial_state=[True, False], extra_slots=6, seed=12)
    check_prefill_checkpoints(kda_prefill_flash, case, [[512, 1024, 1536, 2048], [512]],
                              tolerance_for(torch.bfloat16))


@cpu_only   # CPU tensors: the step plan's kernel needs the interpreter
@pytest.mark.parametrize("offsets, message", [([[20], []], r"sequence 0: .*multiples of the chunk \(16\); got \[20\]"),
                                              ([[], [40]], r"sequence 1: .*0 < offset < 40.*got \[40\]"),
                                              ([[32, 16], []], r"sequence 0: .*must increase; got \[32, 16\]")])
def test_bad_checkpoints_say_what_is_needed(offsets, message):
    """Offsets off the chunk grid or not inside the sequence are refused before any launch; a
    backend that takes none says the engine cuts chunks."""
    from kdaserve.backends.registry import get_spec
    from kdaserve.backends.resolver import ResolvedBackend
    from kdaserve.ops.kda.types import CheckpointRequests, PrefillSeqs

    case = make_kda_case([64, 40], H=2, D=16, extra_slots=4, seed=13)
    ck = CheckpointRequests.build([[(o, 5 + i) for i, o in enumerate(offs)] for offs in offsets], "cpu")
    seqs = PrefillSeqs(case.cu_seqlens, case.state_indices, case.has_initial_state, case.cu_seqlens_cpu, ck)
    before = case.recurrent_state.clone()
    with pytest.raises(ValueError, match=message):
        kda_prefill_flash(case.inputs, case.weights, case.cache, seqs, case.new_out(), segment_len=0,
                          config=dataclasses.replace(CONFIG, chunk=16))
    assert torch.equal(before, case.recurrent_state)
    fla = ResolvedBackend("prefill", "fla", "fla", lambda *a, **k: None, get_spec("prefill", "fla"))
    with pytest.raises(ValueError, match="takes no state checkpoints inside a step; the engine cuts"):
        fla.plan_prefill(seqs, case.T, 2, None)
