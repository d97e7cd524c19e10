"""`chunk` prefill backend (kdaserve.ops.chunk) against the reference and the shared properties.

CPU: Triton's interpreter, fp32/fp16, tiny shapes (H = 2, D = 16, a few chunks: the interpreter
spends ~0.5 s per (chunk, head) program). GPU (marked): bf16, 32 heads x 128, the serving shapes,
a 128K-token sequence (slow), fp64/fp32 ground truth from the reference's chunked form.
"""

import functools

import pytest
import torch

from kdaserve.ops.chunk import kda_prefill_chunk
from kdaserve.ops.chunk.tables import host_chunk_tables
from kdaserve.ops.reference import kda_prefill_reference
from kdaserve.testing import assert_rel_close, make_kda_case, rel_rms, tolerance_for
from kdaserve.testing.properties import (
    check_mixed_equals_alone,
    check_prefill_matches_reference,
    check_split_prefill,
    run_prefill,
    to_fp64,
    valid_rows,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(H=2, D=16, device=DEV)


# ---- host-side chunk tables (no kernels) ----------------------------------------------------------


def test_chunk_tables_cover_every_token_once_and_never_straddle_sequences():
    cu = torch.tensor([0, 5, 5, 133, 134, 198], dtype=torch.int32)  # includes a 0-token sequence
    chunks, first = host_chunk_tables(cu, 64)
    assert chunks.tolist() == [[0, 0, 5], [2, 5, 69], [2, 69, 133], [3, 133, 134], [4, 134, 198]]
    assert first.tolist() == [0, 1, 1, 3, 4]


def test_state_pass_launch_rule_follows_the_number_of_chains():
    """The state pass's V-tile and pipeline depth by (sequence, head) pairs (ChunkConfig; timed on
    the H200 in docs/perf-notes.md). The interpreter ignores pipeline stages, so only this pins them."""
    from kdaserve.ops.chunk import ChunkConfig

    cfg = ChunkConfig()
    assert [cfg.bv(n, h, 128) for n, h in ((1, 16), (2, 16), (1, 32), (3, 16), (7, 32), (8, 32), (16, 64))] == \
        [16, 16, 16, 32, 32, 64, 64]
    assert [cfg.stages_for(bv) for bv in (16, 32, 64)] == [3, 2, 2]
    assert [cfg.warps_for(bv) for bv in (16, 32, 64)] == [4, 4, 8]
    assert cfg.bv(1, 2, 16) == 16 and cfg.bv(1, 2, 32) == 32     # small heads: one tile per head
    forced = ChunkConfig(state_bv=64, state_stages=2, state_warps=4)
    assert (forced.bv(1, 16, 128), forced.stages_for(16), forced.warps_for(64)) == (64, 2, 4)


# ---- against the reference (interpreter on CPU) -----------------------------------------------------


@pytest.mark.parametrize(
    "layout,gate",
    [("SD", "bounded"), ("DS", "unbounded")],
)
def test_matches_reference_with_null_rows_mixed_lengths_and_slow_heads(layout, gate):
    # 1-token sequences next to a two-chunk one with a partial last chunk; a null slot in the middle.
    # The long one resumes from its slot, so its full chunk's w (multiplied by the state) matters.
    case = make_kda_case([1, 70, 3, 1], conv_layout=layout, gate=gate, slow_decay_heads=1, seed=1,
                         has_initial_state=[False, True, True, True], **SMALL)
    case.state_indices[2] = 0
    check_prefill_matches_reference(kda_prefill_chunk, case, tolerance_for(torch.float32), chunk_size=64)


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gate_kernel_matches_reference_gate_elementwise(gate):
    """Gate logits over [-40, 40], one token per sequence so gcum holds each gate alone: every
    element within 2e-5 relative (what fp32 allows for sigmoid(z) = 1/(1 + e^-z) at |z| ~ 100),
    softplus's linear branch above 20 and its log1p far below 0 included: a plain log(1 + e^x)
    would be 100% off where e^x < 6e-8."""
    from kdaserve.ops.chunk.core import chunk_tables
    from kdaserve.ops.chunk.gate import LOG2E, launch_gate_cumsum
    from kdaserve.ops.reference import kda_gate
    from kdaserve.testing.inputs import make_kda_weights

    H, D, T = 2, 16, 64
    weights = make_kda_weights(H, D, gate=gate, device=DEV, generator=torch.Generator().manual_seed(0))
    weights.dt_bias.zero_()
    g1 = torch.linspace(-40, 40, T * H * D, device=DEV).view(T, H, D)
    cu = torch.arange(T + 1, dtype=torch.int32)
    gcum = torch.full((T, H, D), float("nan"), device=DEV)
    launch_gate_cumsum(g1, weights, gcum, chunk_tables(cu, g1.device), torch.arange(1, T + 1, dtype=torch.int32, device=DEV), 64)
    ref = kda_gate(g1.double(), weights.A_log, weights.dt_bias, weights.lower_bound) * LOG2E
    rel = ((gcum.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    assert torch.allclose(gcum.double(), ref, rtol=2e-5, atol=1e-30), f"max relative error {rel:.2e}"


@pytest.mark.parametrize("inverse", ["blocked", "substitution", "blocked-w4-maxnreg", "wide-blocked",
                                     "wide-substitution"])
def test_both_intra_inverses_match_reference_with_correlated_keys(inverse):
    """Both ChunkConfig.intra_inverse paths (bench_prefill.py --sweep times them side by side), on
    a chunk whose keys are strongly correlated (all near one direction, beta near 1): the inverse
    of I + A then has large entries and an error in any blocking level shows at 1e-5. maxnreg only
    reaches the compiler: passing it checks that the launch accepts it."""
    from kdaserve.ops.chunk import ChunkConfig

    case = make_kda_case([70], has_initial_state=True, seed=9, **SMALL)
    P = case.H * case.D
    k = case.qkv[:, P : 2 * P]
    k.mul_(0.2).add_(1.0)  # common direction plus 20% noise: cosine ~0.96 between keys
    case.beta_logits.fill_(4.0)
    if inverse.startswith("wide") and DEV == "cuda":
        pytest.skip("fp32 inputs on a GPU take the per-pair intra (ChunkPlan.intra_wide)")
    blocked = "blocked" in inverse
    cfg = ChunkConfig(intra_inverse="blocked" if blocked else "substitution", intra_inverse_tf32=blocked,
                      intra_warps=4 if inverse.endswith("maxnreg") else 8,
                      intra_maxnreg=168 if inverse.endswith("maxnreg") else None, intra_wide=inverse.startswith("wide"))
    prefill = functools.partial(kda_prefill_chunk, config=cfg)
    check_prefill_matches_reference(prefill, case, tolerance_for(torch.float32), chunk_size=64)


@pytest.mark.parametrize("gate, inverse, dtype", [("bounded", "substitution", torch.float32),
                                                  ("unbounded", "blocked", torch.float32),
                                                  ("unbounded", "substitution", torch.float16),
                                                  ("bounded", "blocked", torch.float16)])
def test_wide_intra_matches_reference(gate, inverse, dtype):
    """ChunkConfig.intra_wide (A by row blocks against every earlier column in one dot) on mixed
    lengths: partial chunks whose column tiles run past the sequence, a null slot, both gates (the
    unbounded one replaces the diagonal blocks with the exact loop's), both inverses, fp16."""
    from kdaserve.ops.chunk import ChunkConfig

    if dtype == torch.float32 and DEV == "cuda":
        pytest.skip("fp32 inputs on a GPU take the per-pair intra (ChunkPlan.intra_wide)")
    # The 1-token sequence is the null slot: the 37-token one keeps a partial chunk through row
    # blocks 0-2 and the 70-token one a 6-token tail.
    case = make_kda_case([1, 70, 37, 128], gate=gate, slow_decay_heads=1, seed=14, dtype=dtype, conv_dtype=dtype,
                         has_initial_state=[False, True, True, False], **SMALL)
    case.state_indices[0] = 0
    cfg = ChunkConfig(intra_inverse=inverse, intra_wide=True)
    check_prefill_matches_reference(functools.partial(kda_prefill_chunk, config=cfg), case, tolerance_for(dtype),
                                    chunk_size=64)


def test_null_rows_leave_output_untouched():
    case = make_kda_case([4, 9], seed=2, **SMALL)
    case.state_indices[0] = -1
    out = run_prefill(kda_prefill_chunk, case)
    assert torch.isnan(out[:4]).all(), "rows of a slot <= 0 were written"
    assert not torch.isnan(out[4:]).any()


def test_fp16_inputs_and_bf16_state_pool():
    case = make_kda_case([33, 2], dtype=torch.float16, state_dtype=torch.bfloat16, seed=4, **SMALL)
    check_prefill_matches_reference(kda_prefill_chunk, case, tolerance_for(torch.float16, torch.bfloat16), chunk_size=64)


@pytest.mark.parametrize("split", [64, 67])
def test_split_prefill_equals_unsplit(split):
    # 64: the second part starts on a chunk boundary; 67: the first part ends mid-chunk.
    check_split_prefill(kda_prefill_chunk, 80, split, tolerance_for(torch.float32), seed=5, **SMALL)


def test_mixed_step_equals_each_sequence_alone():
    check_mixed_equals_alone(kda_prefill_chunk, [1, 20, 66], tolerance_for(torch.float32), seed=6, **SMALL)


def test_strided_inputs_equal_contiguous_bit_for_bit():
    strided = make_kda_case([9, 40], strided=True, seed=7, **SMALL)
    contiguous = make_kda_case([9, 40], strided=False, seed=7, **SMALL)
    assert not strided.qkv.is_contiguous() and contiguous.qkv.is_contiguous()
    out_s, out_c = run_prefill(kda_prefill_chunk, strided), run_prefill(kda_prefill_chunk, contiguous)
    assert torch.equal(out_s, out_c)
    assert torch.equal(strided.recurrent_state, contiguous.recurrent_state)
    assert torch.equal(strided.conv_state, contiguous.conv_state)


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_steepest_gates_stay_finite_and_exact(gate):
    """Every gate at its steepest: LB = -5 on every token (a 64-token chunk spans ~462 in log2
    units; 40 tokens already reach ~288 > 127, fp32's exp2 limit), or an unbounded gate of ~-480 per
    token. Exponents taken over unanchored cumsums would overflow."""
    case = make_kda_case([40], has_initial_state=True, gate=gate, seed=8, **SMALL)
    case.g1.fill_(30.0)
    check_prefill_matches_reference(kda_prefill_chunk, case, tolerance_for(torch.float32), chunk_size=64)


def test_bad_inputs_raise_clear_errors():
    case = make_kda_case([3], dtype=torch.float64, **SMALL)
    with pytest.raises(ValueError, match="takes float32, float16, bfloat16 inputs, got float64"):
        run_prefill(kda_prefill_chunk, case)
    case = make_kda_case([3], H=1, D=24, device=DEV)
    with pytest.raises(ValueError, match=r"supports head sizes \(16, 32, 64, 128\), got D = 24"):
        run_prefill(kda_prefill_chunk, case)


def test_intra_scratch_of_the_wrong_width_is_a_clear_error():
    """launch_intra checks that its A scratch fits the chosen form before launching anything."""
    from kdaserve.ops.chunk.core import chunk_tables
    from kdaserve.ops.chunk.intra import BC, launch_intra

    T, H, D = 3, 1, 16
    f = dict(device=DEV, dtype=torch.float32)
    y, gcum, w = torch.zeros(T, 3 * H * D, **f), torch.zeros(T, H, D, **f), torch.zeros(T, H, D, **f)
    tables = chunk_tables(torch.tensor([0, T], dtype=torch.int32), torch.device(DEV))
    narrow = torch.zeros(T, H, BC, **f)
    with pytest.raises(ValueError, match=r"akk_scratch must be \[T, H, 64\] for wide=True, got \(3, 1, 16\)"):
        launch_intra(y, torch.zeros(T, H, **f), gcum, tables, torch.ones(1, dtype=torch.int32, device=DEV),
                     torch.zeros(T, H, 64, **f), narrow, w, w, w, w, exact_diag=False, precision="ieee", BT=64,
                     wide=True)


# ---- GPU: bf16, serving shapes ------------------------------------------------------------------------

GPU_TOL = tolerance_for(torch.bfloat16)  # 5e-3: bf16 inputs, fp32 state
SHAPES = {"1x8K": [8192], "16x1K": [1024] * 16, "64x512": [512] * 64}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gpu_bf16_serving_shapes_match_fp64_reference(shape, gate):
    case = make_kda_case(SHAPES[shape], H=32, D=128, dtype=torch.bfloat16, gate=gate, slow_decay_heads=4,
                         conv_dtype=torch.bfloat16, device="cuda", seed=11)
    check_prefill_matches_reference(kda_prefill_chunk, case, GPU_TOL, chunk_size=64)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["substitution", "blocked", "substitution tf32", "blocked w4", "wide substitution",
                                    "wide blocked w4", "wide substitution unbounded", "substitution unbounded"])
def test_gpu_intra_variants_match_fp64_reference(config):
    """The ChunkConfig intra variants that bench_prefill.py --sweep times, held to the same bf16
    contract as the default ("wide blocked", run by every other GPU test): one serving shape, the
    bounded gate unless named."""
    from kdaserve.ops.chunk import ChunkConfig

    blocked = "blocked" in config
    cfg = ChunkConfig(intra_inverse="blocked" if blocked else "substitution",
                      intra_inverse_tf32=True if blocked or "tf32" in config else None,
                      intra_warps=4 if "w4" in config else 8, intra_wide="wide" in config)
    case = make_kda_case(SHAPES["16x1K"], H=32, D=128, dtype=torch.bfloat16, slow_decay_heads=4,
                         gate="unbounded" if "unbounded" in config else "bounded",
                         conv_dtype=torch.bfloat16, device="cuda", seed=11)
    check_prefill_matches_reference(functools.partial(kda_prefill_chunk, config=cfg), case, GPU_TOL, chunk_size=64)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gpu_fp32_inputs_at_the_real_head_size_match_fp64_reference(gate):
    """fp32 inputs take their own GPU path (ChunkPlan.intra_wide: per-pair intra, every dot "ieee"
    fp32), which no other GPU test reaches; held to the fp32 contract at D = 128, mixed lengths,
    partial chunks, slow-decay heads and a null slot."""
    case = make_kda_case([300, 1, 64, 700], H=8, D=128, dtype=torch.float32, conv_dtype=torch.float32, gate=gate,
                         slow_decay_heads=2, device="cuda", seed=17)
    case.state_indices[1] = 0
    check_prefill_matches_reference(kda_prefill_chunk, case, tolerance_for(torch.float32), chunk_size=64)


@pytest.mark.gpu
def test_gpu_mixed_lengths_null_rows_and_split():
    case = make_kda_case([1, 700, 1, 64, 130, 2], H=32, D=128, dtype=torch.bfloat16, slow_decay_heads=4,
                         conv_dtype=torch.bfloat16, conv_layout="DS", device="cuda", seed=12)
    case.state_indices[3] = 0
    check_prefill_matches_reference(kda_prefill_chunk, case, GPU_TOL, chunk_size=64)
    check_split_prefill(kda_prefill_chunk, 1000, 333, GPU_TOL, H=32, D=128, dtype=torch.bfloat16,
                        conv_dtype=torch.bfloat16, device="cuda", seed=13)


@pytest.mark.gpu
def test_gpu_strided_equals_contiguous_and_no_host_sync():
    kw = dict(H=32, D=128, dtype=torch.bfloat16, conv_dtype=torch.bfloat16, device="cuda", seed=14)
    strided, contiguous = make_kda_case([300, 5, 77], strided=True, **kw), make_kda_case([300, 5, 77], strided=False, **kw)
    # Compile outside the sync check, on other lengths so the checked call builds its own tables.
    run_prefill(kda_prefill_chunk, make_kda_case([300, 6, 77], **kw))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync inside the call raises
    try:
        out_s = run_prefill(kda_prefill_chunk, strided)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out_c = run_prefill(kda_prefill_chunk, contiguous)
    assert torch.equal(out_s, out_c) and torch.equal(strided.recurrent_state, contiguous.recurrent_state)


def _fp32_ground_truth(case):
    """The reference's chunk-64 form in fp32 (fp64 tensors of a 128K case would not fit the GPU),
    with exact fp32 matmuls, on copies of the case's pools that it advances to their final states.

    Every conversion starts from the clone's own tensors: `.float()` of an fp32 tensor is the
    tensor itself, so converting the *case's* fp32 state pool would let the reference write its
    final state into the pool the backend then starts from."""
    ref = case.clone()
    P = case.H * case.D
    ref.proj = ref.proj.float()
    ref.qkv, ref.beta_logits = ref.proj[:, : 3 * P], ref.proj[:, 3 * P : 3 * P + case.H]
    ref.g1, ref.g2 = case.g1.to(torch.float32, copy=True), case.g2.to(torch.float32, copy=True)
    ref.conv_state, ref.recurrent_state = ref.conv_state.float(), ref.recurrent_state.float()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no tf32 in the ground truth, whatever ran before
    try:
        out = run_prefill(functools.partial(kda_prefill_reference, chunk_size=64), ref, out_dtype=torch.float32)
    finally:
        torch.set_float32_matmul_precision(precision)
    return ref, out


def test_fp32_ground_truth_runs_on_copies_of_the_pools():
    """The 128K test's ground truth must leave the case's pools as they were: `.float()` of an fp32
    pool is the pool itself, so converting the case's state with it let the reference write its
    final state into the pool the kernel then started from (128K on the GPU: 2.6e-2 / 3.0e-2 output
    error, none of it the kernel's). Reference runs only, no kernels: fast on CPU."""
    case = make_kda_case([70], H=2, D=16, dtype=torch.bfloat16, conv_dtype=torch.bfloat16, slow_decay_heads=1,
                         has_initial_state=True, seed=16)
    assert case.recurrent_state.dtype == torch.float32  # the pool dtype where the alias happened
    before_rec, before_conv = case.recurrent_state.clone(), case.conv_state.clone()
    ref, ref_out = _fp32_ground_truth(case)
    assert torch.equal(case.recurrent_state, before_rec), "the ground truth wrote into the case's state pool"
    assert torch.equal(case.conv_state, before_conv), "the ground truth wrote into the case's conv pool"
    # ... while its own copies did advance, and agree with the fp64 reference.
    slot = case.state_indices.tolist()
    assert not torch.equal(ref.recurrent_state[slot], before_rec[slot])
    ref64 = to_fp64(case)
    out64 = run_prefill(functools.partial(kda_prefill_reference, chunk_size=64), ref64, out_dtype=torch.float64)
    assert_rel_close(ref_out, out64, tolerance_for(torch.float32), "fp32 ground truth output")
    assert_rel_close(ref.recurrent_state[slot], ref64.recurrent_state[slot], tolerance_for(torch.float32),
                     "fp32 ground truth state")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gpu_128k_token_sequence(gate):
    case = make_kda_case([131072], H=32, D=128, dtype=torch.bfloat16, gate=gate, slow_decay_heads=4,
                         conv_dtype=torch.bfloat16, has_initial_state=True, device="cuda", seed=15)
    slot = case.state_indices.tolist()
    initial = case.recurrent_state[slot].clone()
    ref, ref_out = _fp32_ground_truth(case)
    assert torch.equal(case.recurrent_state[slot], initial), "the ground truth wrote into the backend's pool"
    out = run_prefill(kda_prefill_chunk, case)
    rows = valid_rows(case)
    assert_rel_close(out[rows], ref_out[rows], GPU_TOL, "128K output")
    assert_rel_close(case.recurrent_state[slot], ref.recurrent_state[slot], GPU_TOL, "128K final state")
    # The slow-decay heads carry the whole context: hold them to the same bound on their own.
    slow = slice(case.H - 4, case.H)
    assert rel_rms(out[:, slow], ref_out[:, slow]) < GPU_TOL
    assert rel_rms(case.recurrent_state[slot][:, slow], ref.recurrent_state[slot][:, slow]) < GPU_TOL
