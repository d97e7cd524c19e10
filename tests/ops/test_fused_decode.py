"""`fused` decode (one launch) against the torch reference, and against `chain` on the GPU.

On CPU the kernel runs in Triton's interpreter (fp32/fp16 inputs, tiny heads; programs run one
after the other, so the split path's last-arriving program is the last in grid order); bf16 inputs,
real head sizes, truly concurrent split programs, CUDA graphs and the 65,535-program grid limit are
GPU tests.
"""

import functools
from dataclasses import replace

import pytest
import torch
from compiled_mode import run_compiled

from kdaserve.ops.kda.fused import FusedDecodeConfig, fused_conv_weight_layout, kda_decode_fused, launch_fused_decode
from kdaserve.ops.kda.fused.decode import default_config, split_workspace
from kdaserve.ops.kda.reference import kda_decode_reference, kda_prefill_reference
from kdaserve.testing import assert_rel_close, make_kda_case, tolerance_for
from kdaserve.testing.inputs import make_kda_weights
from kdaserve.testing.properties import (
    check_decode_agrees,
    check_decode_matches_reference,
    check_spec_resume,
    run_decode,
    with_fused_decode_layout,
    with_padding_rows,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(H=2, D=16, device=DEV)
WHOLE_HEAD = functools.partial(launch_fused_decode, FusedDecodeConfig(block_v=None, num_warps=4))
SPLIT4 = functools.partial(launch_fused_decode, FusedDecodeConfig(block_v=4, num_warps=2))  # 4 programs per head




def _spec_case(N, S, seed, **kw):
    """N sequences verifying S+1 tokens; each owns a conv slot and S+1 distinct state slots."""
    case = make_kda_case([S + 1] * N, spec_tokens=S, extra_slots=N * (S + 1) + 2, seed=seed, **kw)
    free = [s for s in range(1, case.recurrent_state.shape[0]) if s not in set(case.state_indices.tolist())]
    spec = torch.tensor(free[: N * (S + 1)], dtype=torch.int32).view(N, S + 1)
    accepted = torch.arange(N, dtype=torch.int32) % (S + 1) + 1
    return case, spec.to(case.qkv.device), accepted.to(case.qkv.device)


# ---------------------------------------------------------------- CPU (interpreter) and GPU


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_matches_reference_with_padding_rows(layout, gate):
    """Strided q|k|v and beta views of the projection, slow-decay heads, rows with slot 0 and -1:
    output, state and conv state match; other slots bit-for-bit; padding rows stay NaN."""
    case = make_kda_case([1] * 6, conv_layout=layout, gate=gate, slow_decay_heads=1, seed=1, **SMALL)
    check_decode_matches_reference(kda_decode_fused, with_fused_decode_layout(with_padding_rows(case, 1, 4)), 1e-5)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("fn", [WHOLE_HEAD, SPLIT4], ids=["whole_head", "split4"])
def test_launch_shapes_match_reference(layout, fn):
    """One program per head, and a head split over 4 programs (workspace + last-arriving program
    normalizes and rewrites the q/k conv window), equal the reference."""
    case = make_kda_case([1] * 5, conv_layout=layout, gate="unbounded", seed=2, **SMALL)
    check_decode_matches_reference(fn, with_padding_rows(case, 2), 1e-5)


def test_split_leaves_the_workspace_at_rest():
    """After every launch (both ways a split head meets) the counters are 0 and the o rows hold the
    sentinel again (no memset launch; CUDA graphs replay on them); later steps still match."""
    from kdaserve.ops.kda.fused.decode_kernel import WS_SENTINEL
    for step, fn in enumerate([SPLIT4, SPLIT4]):
        case = make_kda_case([1] * 4, seed=30 + step, **SMALL)
        check_decode_matches_reference(fn, with_padding_rows(case, 1), 1e-5)
        counters, o = split_workspace(case.qkv.device, 1, 1)
        assert int(counters.abs().sum()) == 0, "a split launch left a head counter non-zero"
        assert bool((o == WS_SENTINEL.value).all()), "a split launch left workspace values behind"


def test_split_workspace_grows_and_keeps_outgrown_buffers():
    dev = torch.device(DEV)
    c0, o0 = split_workspace(dev, 1, 1)
    c1, o1 = split_workspace(dev, c0.numel() + 1, o0.numel() + 1)
    assert c1.numel() > c0.numel() and o1.numel() > o0.numel() and not int(c1.abs().sum())
    from kdaserve.ops.kda.fused import decode as mod
    assert any(t is c0 for t in mod._RETIRED), "an outgrown buffer must stay alive for captured graphs"
    assert split_workspace(dev, 1, 1)[0] is c1


def test_default_config_by_batch():
    """Heads are split, more finely when there are few of them (latency-bound)."""
    for tokens in (1, 4):
        for state_bytes in (4, 2):
            configs = [default_config(128, tokens, nh, state_bytes) for nh in (32, 256, 1024, 2048, 65536)]
            shapes = [c.block_v for c in configs if not c.stream]  # (the stream shape: test_fused_stream.py)
            assert all(b is not None and b < 128 for b in shapes) and shapes == sorted(shapes), shapes
    assert default_config(16, 1, 32).block_v <= 16


def test_fp16_inputs_and_contiguous_inputs_without_decode_layout():
    """fp16 inputs (fp32 state), contiguous q|k|v, forget_logits/output_gate_logits/out as [T, P]; conv weight derived
    per call."""
    case = make_kda_case([1] * 4, dtype=torch.float16, strided=False, seed=3, **SMALL)
    T, P = case.T, case.H * case.D
    case.forget_logits, case.output_gate_logits = case.forget_logits.reshape(T, P), case.output_gate_logits.reshape(T, P)

    def fused_flat_out(out, **kw):
        flat = out.view(T, P)
        kda_decode_fused(out=flat, **kw)

    check_decode_matches_reference(fused_flat_out, case, tolerance_for(torch.float16))


def test_bf16_state_pool():
    case = make_kda_case([1] * 4, state_dtype=torch.bfloat16, seed=4, **SMALL)
    check_decode_matches_reference(kda_decode_fused, case, tolerance_for(torch.float32, torch.bfloat16))


def test_plain_decode_on_a_pool_sized_for_drafts():
    """A conv state of W-1+S rows in a plain decode step: the window is the newest W-1 rows and
    all rows shift by one."""
    for layout in ("SD", "DS"):
        case = make_kda_case([1] * 3, spec_tokens=2, conv_layout=layout, seed=5, **SMALL)
        check_decode_matches_reference(kda_decode_fused, case, 1e-5)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("fn", [kda_decode_fused, SPLIT4], ids=["default", "split4"])
def test_spec_verify_matches_reference(layout, fn):
    """S+1 tokens per sequence: start from spec[n, accepted-1], state after token t into spec[n, t];
    a padding row (first slot 0) and a draft slot of -1 (not stored) included."""
    case, spec, accepted = _spec_case(5, 2, seed=6, conv_layout=layout, **SMALL)
    spec[1, 0] = 0  # padding row: recurrence and output skipped
    case.state_indices[1] = 0
    spec[2, 2] = -1  # this draft's state is not kept
    accepted[2] = 2
    spec[3, 0] = 0  # recurrence skipped, conv still updated (its conv slot is > 0), as the reference does
    check_decode_matches_reference(
        fn, with_fused_decode_layout(case), 1e-5, spec_state_indices=spec, num_accepted_tokens=accepted
    )


@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
def test_spec_verify_then_resume_equals_accepted_only_run(accepted):
    check_spec_resume(kda_prefill_reference, kda_decode_fused, accepted, 1e-5, S=3, **SMALL)


@pytest.mark.parametrize("fn", [SPLIT4], ids=["split4"])
def test_spec_resume_ds_layout_split(fn):
    check_spec_resume(kda_prefill_reference, fn, 2, 1e-5, S=2, conv_layout="DS", **SMALL)


def test_reads_the_derived_conv_weight_when_set():
    """weights.conv_weight_decode is what the kernel reads: a stale copy gives stale results, and
    refreshing it in place (same address) restores agreement with the reference."""
    case = make_kda_case([1] * 3, seed=7, **SMALL)
    buf = fused_conv_weight_layout(case.weights.conv_weight)
    addr = buf.data_ptr()
    case.weights.conv_weight_decode = buf
    case.weights.conv_weight = case.weights.conv_weight * 1.5  # a weight write the layer must follow
    stale = case.clone()
    with pytest.raises(AssertionError, match="decode output"):
        check_decode_matches_reference(kda_decode_fused, stale, 1e-5)
    assert fused_conv_weight_layout(case.weights.conv_weight, out=buf).data_ptr() == addr
    check_decode_matches_reference(kda_decode_fused, case, 1e-5)


def test_empty_step_is_a_no_op():
    """T = 0 passes the shared checks (kdaserve/ops/kda/checks.py) and launches nothing."""
    case = make_kda_case([], **SMALL)
    before = case.recurrent_state.clone(), case.conv_state.clone()
    run_decode(kda_decode_fused, case)
    assert torch.equal(before[0], case.recurrent_state) and torch.equal(before[1], case.conv_state)


def test_conv_weight_layout_values():
    w = torch.randn(3 * 8, 4)
    d = fused_conv_weight_layout(w)
    assert d.shape == (3, 4, 8) and d.is_contiguous()
    for g in range(3):
        assert torch.equal(d[g], w[g * 8 : (g + 1) * 8].T)
    with pytest.raises(ValueError, match=r"\[3, W, P\]"):
        fused_conv_weight_layout(w, out=torch.empty(3, 8, 4))


def test_bad_inputs_raise_clear_errors():
    case = make_kda_case([1] * 2, seed=8, **SMALL)
    args = case.decode_args()
    out = case.new_out()
    w3 = make_kda_weights(2, 16, conv_width=3, device=DEV)
    with pytest.raises(ValueError, match=r"supports conv widths \(4,\), got W = 3"):
        kda_decode_fused(out=out, **{**args, "weights": w3,
                                     "cache": replace(args["cache"], conv_state=case.conv_state[:, :2].contiguous())})
    bad = make_kda_weights(2, 16, device=DEV)
    bad.conv_weight_decode = torch.zeros(3, 4, 31, device=DEV)
    with pytest.raises(ValueError, match="conv_weight_decode"):
        kda_decode_fused(out=out, **{**args, "weights": bad})
    with pytest.raises(ValueError, match="K contiguous"):
        kda_decode_fused(out=out, **{**args, "cache": replace(args["cache"],
                                                              recurrent_state=case.recurrent_state.transpose(2, 3))})
    with pytest.raises(ValueError, match="out must be viewable"):
        kda_decode_fused(out=out.transpose(1, 2).contiguous().transpose(1, 2), **args)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        launch_fused_decode(FusedDecodeConfig(block_v=12), out=out, **args)
    case3, _, _ = _spec_case(2, 1, seed=9, **SMALL)
    with pytest.raises(ValueError, match="one token per sequence"):
        kda_decode_fused(out=case3.new_out(), **case3.decode_args())


def test_spec_step_with_fewer_drafts_than_the_conv_pool_holds_is_refused():
    """S+1 = 2 tokens cannot refill a conv state sized for S = 3 drafts (6 rows): the window would
    start before the slot's first row (reading the neighbouring slot). The reference refuses it;
    so must the fused kernel's entry point, before anything is written."""
    case = make_kda_case([2, 2], spec_tokens=3, extra_slots=12, seed=3, **SMALL)
    used = set(case.state_indices.tolist())
    spec = torch.tensor([s for s in range(1, 20) if s not in used][:4], dtype=torch.int32).view(2, 2).to(DEV)
    accepted = torch.ones(2, dtype=torch.int32, device=DEV)
    conv0, rec0 = case.conv_state.clone(), case.recurrent_state.clone()
    with pytest.raises(ValueError, match=r"S\+1 = 4 tokens"):
        kda_decode_fused(out=case.new_out(), **case.decode_args(spec, accepted))
    assert torch.equal(case.conv_state, conv0) and torch.equal(case.recurrent_state, rec0)


# ---------------------------------------------------------------- GPU only

GPU_SHAPE = dict(H=16, D=128, device="cuda")


GPU_SHAPES = {  # every launch shape the default rule or the benchmark sweep can pick, both ways of meeting
    "whole_w8": FusedDecodeConfig(None, 8), "bv4_w1": FusedDecodeConfig(4, 1),
    "bv8_w1": FusedDecodeConfig(8, 1), "bv32_w4": FusedDecodeConfig(32, 4),
    "bv32_w4_sf": FusedDecodeConfig(32, 4, store_first=True), "bv64_w4": FusedDecodeConfig(64, 4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_gpu_bf16_matches_reference(layout, gate):
    case = make_kda_case([1] * 37, dtype=torch.bfloat16, conv_layout=layout, gate=gate, slow_decay_heads=2,
                         seed=20, **GPU_SHAPE)
    check_decode_matches_reference(kda_decode_fused, with_fused_decode_layout(with_padding_rows(case, 3, 17, 30)),
                                   tolerance_for(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_launch_shapes_over_consecutive_steps(name):
    """Each launch shape, three steps in a row on the same pools (fresh tokens each step): a split
    head whose counter were not reset, or whose q/k window were shifted before a sibling read it,
    gives NaN rows or a wrong output/conv state in a later step."""
    fn = functools.partial(launch_fused_decode, GPU_SHAPES[name])
    case = with_fused_decode_layout(with_padding_rows(make_kda_case([1] * 45, dtype=torch.bfloat16, seed=26, **GPU_SHAPE), 3, 17))
    for step in range(3):
        fresh = make_kda_case([1] * 45, dtype=torch.bfloat16, seed=60 + step, **GPU_SHAPE)
        case.proj.copy_(fresh.proj)
        case.forget_logits.copy_(fresh.forget_logits)
        case.output_gate_logits.copy_(fresh.output_gate_logits)
        check_decode_matches_reference(fn, case, tolerance_for(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [FusedDecodeConfig(32, 4), FusedDecodeConfig(8, 1)], ids=["bv32", "bv8"])
def test_gpu_split_heads_over_several_waves(config):
    """300 sequences x 32 heads x D/block_v programs: far more than one wave, so siblings of a head
    run on different SMs at different times."""
    case = make_kda_case([1] * 300, H=32, D=128, dtype=torch.bfloat16, extra_slots=4, seed=27, device="cuda")
    fn = functools.partial(launch_fused_decode, config)
    check_decode_matches_reference(fn, with_fused_decode_layout(with_padding_rows(case, 7, 150)), tolerance_for(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_bf16_state_matches_reference():
    case = make_kda_case([1] * 33, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=21, **GPU_SHAPE)
    check_decode_matches_reference(kda_decode_fused, with_fused_decode_layout(case),
                                   tolerance_for(torch.bfloat16, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("config", [None, FusedDecodeConfig(None, 8), FusedDecodeConfig(32, 4)],
                         ids=["default", "whole", "bv32"])
def test_gpu_spec_verify(layout, config):
    fn = functools.partial(launch_fused_decode, config)
    case, spec, accepted = _spec_case(9, 3, seed=22, dtype=torch.bfloat16, conv_layout=layout, **GPU_SHAPE)
    spec[4, 0] = 0
    check_decode_matches_reference(fn, with_fused_decode_layout(case), tolerance_for(torch.bfloat16),
                                   spec_state_indices=spec, num_accepted_tokens=accepted)
    check_spec_resume(kda_prefill_reference, fn, 2, tolerance_for(torch.bfloat16), S=3,
                      dtype=torch.bfloat16, **GPU_SHAPE)


@pytest.mark.gpu
def test_gpu_matches_chain():
    chain = pytest.importorskip("kdaserve.ops.kda.chain").kda_decode_chain
    case = make_kda_case([1] * 64, dtype=torch.bfloat16, seed=23, **GPU_SHAPE)
    check_decode_agrees(kda_decode_fused, chain, with_fused_decode_layout(with_padding_rows(case, 5)),
                        tolerance_for(torch.bfloat16),
                        "fused vs chain")


@pytest.mark.gpu
@pytest.mark.parametrize("spec_tokens, config", [(0, None), (0, FusedDecodeConfig(32, 4)), (2, None),
                                                 (2, FusedDecodeConfig(None, 8)), (2, FusedDecodeConfig(16, 4))],
                         ids=["decode", "decode_bv32", "verify", "verify_whole", "verify_bv16"])
def test_gpu_cuda_graph_replay_equals_eager(spec_tokens, config):
    """Capture one step, then replay it on fresh inputs copied into the captured buffers: the same
    result as an eager call on a copy of the pools (plain decode at N*H = 384 takes the split path:
    the workspace counters must be back at 0 after every replay)."""
    fn = functools.partial(launch_fused_decode, config)
    N, S1 = 24, spec_tokens + 1
    if spec_tokens:
        case, spec, accepted = _spec_case(N, spec_tokens, seed=24, dtype=torch.bfloat16, **GPU_SHAPE)
        kw = dict(spec_state_indices=spec, num_accepted_tokens=accepted)
    else:
        case, kw = make_kda_case([1] * N, dtype=torch.bfloat16, seed=24, **GPU_SHAPE), {}
    with_fused_decode_layout(case)
    out = case.new_out()
    args = dict(out=out, **case.decode_args(**kw))
    fn(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(**args)
    for step in range(3):
        fresh = make_kda_case([S1] * N, dtype=torch.bfloat16, seed=100 + step, **GPU_SHAPE)
        case.proj.copy_(fresh.proj)
        case.forget_logits.copy_(fresh.forget_logits)
        case.output_gate_logits.copy_(fresh.output_gate_logits)
        case.state_indices.copy_(case.state_indices.flip(0))  # new slot order
        case.state_indices[step] = 0  # and a padding row
        if spec_tokens:
            kw["num_accepted_tokens"].copy_(torch.randint(1, S1 + 1, (N,), device="cuda", dtype=torch.int32))
        eager = case.clone()
        out_e = run_decode(fn, eager, **kw)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out.isnan(), out_e.isnan()), f"step {step}: padding rows differ"
        assert torch.equal(out.nan_to_num(), out_e.nan_to_num()), f"step {step}: graph output differs from eager"
        assert torch.equal(case.recurrent_state, eager.recurrent_state), f"step {step}: graph state differs"
        assert torch.equal(case.conv_state, eager.conv_state), f"step {step}: graph conv state differs"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_grid_beyond_65535_programs():
    """1100 sequences x 64 heads = 70,400 programs: more than grid axis z could hold."""
    N, H = 1100, 64
    case = make_kda_case([1] * N, H=H, D=32, dtype=torch.bfloat16, extra_slots=0, seed=25, device="cuda")
    ref = case.clone()
    out = run_decode(kda_decode_fused, case)
    last = slice(N - 10, N)  # the last programs of the grid
    sub = ref.clone()
    sub.proj, sub.forget_logits, sub.output_gate_logits = ref.proj[last], ref.forget_logits[last], ref.output_gate_logits[last]
    P = H * 32
    sub.qkv, sub.beta_logits = sub.proj[:, : 3 * P], sub.proj[:, 3 * P : 3 * P + H]
    sub.state_indices, sub.seq_lens = ref.state_indices[last], [1] * 10
    ref_out = run_decode(kda_decode_reference, sub)
    assert_rel_close(out[last].float(), ref_out.float(), tolerance_for(torch.bfloat16), "last programs of a huge grid")
    slots = sub.state_indices.long()
    assert_rel_close(case.recurrent_state[slots], sub.recurrent_state[slots], tolerance_for(torch.bfloat16), "their states")


# ---------------------------------------------------------------- CPU: compiled mode, not just the interpreter

_COMPILE = r'''
import inspect, re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdaserve.ops.kda.fused.decode_kernel import kda_fused_decode_kernel as kernel

params = list(inspect.signature(kernel.fn).parameters)
bf, f32, i32 = "*bf16", "*fp32", "*i32"
# (BV, warps, tokens, state, gate dtype): the default shapes (decode small/large, bf16 large, verify), the
# whole head, and Ling-3's gate rounded to bf16
for bv, warps, tokens, state, gate_dt in ((8, 1, 1, f32, tl.float32), (64, 4, 1, f32, tl.float32),
                                          (32, 4, 4, bf, tl.float32), (128, 8, 1, f32, tl.float32),
                                          (8, 1, 1, f32, tl.bfloat16)):
    types = dict(qkv=bf, forget_logits=bf, beta_logits=bf, output_gate_logits=bf, conv_w=f32, A_log=f32, dt_bias=f32,
                 norm_w=f32, conv_state=bf,
                 state=state, state_indices=i32, spec_indices=i32, num_accepted=i32, out=bf, ws_o=i32, ws_count=i32,
                 lower_bound="fp32", norm_eps="fp32")
    const = dict(H=32, D=128, L=2 + tokens, TOKENS=tokens, SCALE=128**-0.5, IS_SPEC=tokens > 1, BOUNDED_GATE=True, BV=bv,
                 WIN_REGS=bv <= 16, STORE_FIRST=False, GATE_DT=gate_dt)
    sig = {p: "constexpr" if p in const else types.get(p, "i32") for p in params}
    div16 = [p for p in params if p not in const and (types.get(p, "").startswith("*") or p.startswith("stride"))]
    src = ASTSource(kernel, sig, constexprs={(params.index(k),): v for k, v in const.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in div16})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
    # The state tile must move in 16-byte accesses (the kernel is bound by state traffic).
    assert re.search(r"ld\.global[^\n]*\.v4", ptx) and re.search(r"st\.global[^\n]*\.v4", ptx), "state not vectorized"
    if bv < 128:  # the split heads meet as designed
        assert "ld.volatile" not in ptx and "atom.global.gpu.acq_rel" in ptx, bv  # arrival counter, no polling
print("ok")
'''


def test_kernel_compiles_for_sm90_without_a_gpu():
    """Triton's compiled mode (not the interpreter) accepts the kernel in its default shapes, ptxas
    included: catches compile-only errors (e.g. a variable retyped inside a runtime branch) before a
    GPU run."""
    run_compiled(["-c", _COMPILE], timeout=600)
