"""The `chain` decode backend (conv update -> recurrence -> gated norm) held to the decode contract."""


import pytest
import torch
from compiled_mode import run_compiled

from kdaserve.ops.kda.chain import kda_decode_chain
from kdaserve.ops.kda.reference import kda_prefill_reference
from kdaserve.ops.kda.types import DecodeSeqs
from kdaserve.testing import make_kda_case, tolerance_for
from kdaserve.testing.properties import check_decode_matches_reference, check_long_decode, check_spec_resume, run_decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_decode_matches_reference_with_padding(layout, gate):
    case = make_kda_case([1] * 5, H=2, D=16, conv_layout=layout, gate=gate, slow_decay_heads=1, seed=30, device=DEV)
    case.state_indices[1] = 0
    case.state_indices[3] = -1
    check_decode_matches_reference(kda_decode_chain, case, tolerance_for(torch.float32))


def test_decode_fp16_inputs_d32():
    case = make_kda_case([1] * 3, H=2, D=32, dtype=torch.float16, seed=31, device=DEV)
    check_decode_matches_reference(kda_decode_chain, case, tolerance_for(torch.float16))


def test_speculative_verify_matches_reference():
    S, N = 2, 3
    case = make_kda_case([S + 1] * N, H=2, D=16, spec_tokens=S, seed=32, device=DEV)
    spec = torch.arange(1, 1 + N * (S + 1), dtype=torch.int32, device=DEV).view(N, S + 1)
    case.state_indices = spec[:, -1].contiguous()  # conv slot = the row's home slot
    spec[1, 0] = 0  # padding row
    case.state_indices[1] = 0
    accepted = torch.tensor([2, 1, 3], dtype=torch.int32, device=DEV)
    check_decode_matches_reference(kda_decode_chain, case, tolerance_for(torch.float32),
                                   spec_state_indices=spec, num_accepted_tokens=accepted)


def test_out_of_range_accepted_counts_are_clamped_not_read_outside_the_row():
    """num_accepted_tokens outside [1, S+1] (a caller's bug) acts as the nearest valid count, like
    the fused kernel: no read of spec[n, -1] or of a neighbouring conv slot's rows."""
    S, N = 2, 3
    case = make_kda_case([S + 1] * N, H=2, D=16, spec_tokens=S, seed=33, device=DEV)
    spec = torch.arange(1, 1 + N * (S + 1), dtype=torch.int32, device=DEV).view(N, S + 1)
    case.state_indices = spec[:, -1].contiguous()
    clamped = case.clone()
    out_bad = run_decode(kda_decode_chain, case, spec_state_indices=spec,
                         num_accepted_tokens=torch.tensor([0, S + 5, 2], dtype=torch.int32, device=DEV))
    out_ok = run_decode(kda_decode_chain, clamped, spec_state_indices=spec,
                        num_accepted_tokens=torch.tensor([1, S + 1, 2], dtype=torch.int32, device=DEV))
    assert torch.equal(out_bad, out_ok)
    assert torch.equal(case.recurrent_state, clamped.recurrent_state)
    assert torch.equal(case.conv_state, clamped.conv_state)


@pytest.mark.parametrize("accepted,layout", [(1, "SD"), (2, "DS"), (4, "SD")])
def test_spec_resume_equals_accepted_only_run(accepted, layout):
    check_spec_resume(kda_prefill_reference, kda_decode_chain, accepted, tolerance_for(torch.float32), S=3,
                      H=1, D=16, conv_layout=layout, device=DEV)


def test_rejects_bad_metadata():
    case = make_kda_case([1] * 2, H=1, D=16, seed=33)
    with pytest.raises(ValueError, match="one token per sequence"):
        kda_decode_chain(
            out=case.new_out(), **{**case.decode_args(), "seqs": DecodeSeqs(case.state_indices[:1])})


# ---------------------------------------------------------------- GPU: bf16, real shapes, graphs

def _gpu_case(N, state_dtype, layout="SD", S=0, **kw):
    return make_kda_case([S + 1] * N, H=32, D=128, dtype=torch.bfloat16, conv_dtype=torch.bfloat16,
                         state_dtype=state_dtype, conv_layout=layout, spec_tokens=S, slow_decay_heads=8,
                         device="cuda", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,layout,gate", [(1, "SD", "bounded"), (64, "DS", "unbounded"), (512, "SD", "bounded")])
def test_gpu_decode_bf16(N, layout, gate, state_dtype):
    case = _gpu_case(N, state_dtype, layout, gate=gate, seed=34)
    if N > 1:
        case.state_indices[::11] = 0
    check_decode_matches_reference(kda_decode_chain, case, tolerance_for(torch.bfloat16, state_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_speculative_bf16(state_dtype):
    S, N = 3, 128
    case = _gpu_case(N, state_dtype, S=S, seed=35)
    spec = (torch.randperm(case.recurrent_state.shape[0] - 1)[: N * (S + 1)] + 1).to(torch.int32).view(N, S + 1).cuda()
    case.state_indices = spec[:, -1].contiguous()
    spec[::9, 0] = 0
    case.state_indices[::9] = 0
    accepted = torch.randint(1, S + 2, (N,), dtype=torch.int32, device="cuda")
    check_decode_matches_reference(kda_decode_chain, case, tolerance_for(torch.bfloat16, state_dtype),
                                   spec_state_indices=spec, num_accepted_tokens=accepted)


@pytest.mark.gpu
@pytest.mark.parametrize("accepted", [1, 3])
def test_gpu_spec_resume_bf16(accepted):
    check_spec_resume(kda_prefill_reference, kda_decode_chain, accepted, tolerance_for(torch.bfloat16), S=3,
                      H=32, D=128, dtype=torch.bfloat16, device="cuda", slow_decay_heads=8)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager():
    """Captured once, replayed on new inputs copied into the captured buffers: same as eager."""
    N = 64
    case = _gpu_case(N, torch.float32, seed=36)
    case.state_indices[::7] = 0
    eager = case.clone()
    args = case.decode_args()
    out = case.new_out()
    for _ in range(2):  # warm up (compiles) outside the graph, on scratch copies of the pools
        scratch = case.clone()
        kda_decode_chain(out=torch.empty_like(out), **scratch.decode_args())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    snap_conv, snap_rec = case.conv_state.clone(), case.recurrent_state.clone()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        kda_decode_chain(out=out, **args)
    torch.cuda.synchronize()
    case.conv_state.copy_(snap_conv)
    case.recurrent_state.copy_(snap_rec)  # capture may have run nothing, but restore regardless
    fresh = make_kda_case([1] * N, H=32, D=128, dtype=torch.bfloat16, seed=37, device="cuda")
    case.proj.copy_(fresh.proj)
    eager.proj.copy_(fresh.proj)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out = run_decode(kda_decode_chain, eager)
    rows = case.state_indices > 0
    assert torch.equal(out[rows], ref_out[rows])
    assert torch.isnan(out[~rows]).all()
    assert torch.equal(case.recurrent_state, eager.recurrent_state)
    assert torch.equal(case.conv_state, eager.conv_state)



def test_consecutive_decode_steps_track_reference():
    case = make_kda_case([1] * 2, H=1, D=16, slow_decay_heads=1, seed=39, device=DEV)
    check_long_decode(kda_decode_chain, case, 4, tolerance_for(torch.float32))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_long_decode_slow_decay_heads(state_dtype):
    check_long_decode(kda_decode_chain, _gpu_case(8, state_dtype, seed=40, extra_slots=1), 512,
                      tolerance_for(torch.bfloat16, state_dtype))


# ---------------------------------------------------------------- CPU: compiled mode, not just the interpreter

_COMPILE_ALL = r'''
import inspect, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdaserve.ops.kda.conv.update_kernel import conv_update_kernel
from kdaserve.ops.kda.conv.varlen_kernel import conv_varlen_out_kernel, conv_varlen_state_kernel
from kdaserve.ops.norm.gated_rms_norm import gated_rms_norm_kernel
from kdaserve.ops.kda.recurrent.kernel import kda_recurrent_kernel

def compile_for_sm90(fn, types, constexprs):
    signature = inspect.signature(fn.fn).parameters
    params = list(signature)
    # Constexpr options launchers may leave out take their defaults, as at such a launch.
    constexprs = {**{p: v.default for p, v in signature.items() if p not in constexprs and p not in types
                     and v.default is not inspect.Parameter.empty and "constexpr" in str(v.annotation)}, **constexprs}
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    # What the launcher specializes at run time: 16-aligned pointers and strides divisible by 16.
    div16 = [p for p in params if p not in constexprs and (types.get(p, "").startswith("*") or p.startswith("stride"))]
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in div16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

bf, f32, i32 = "*bf16", "*fp32", "*i32"
compile_for_sm90(conv_varlen_out_kernel, dict(x_ptr=bf, w_ptr=f32, state_ptr=bf, y_ptr=bf, cu_ptr=i32, idx_ptr=i32,
                 his_ptr="*i1", block_seq_ptr=i32, block_t0_ptr=i32), dict(W=4, BT=32, BC=128))
compile_for_sm90(conv_varlen_state_kernel, dict(x_ptr=bf, state_ptr=bf, cu_ptr=i32, idx_ptr=i32, his_ptr="*i1"),
                 dict(BL=8, BC=128))
for acc in (False, True):
    compile_for_sm90(conv_update_kernel, dict(x_ptr=bf, w_ptr=f32, state_ptr=bf, y_ptr=f32, idx_ptr=i32, acc_ptr=i32),
                     dict(W=4, BM=4 if acc else 2, BL=8, BC=256, HAS_ACCEPTED=acc))
for has_index in (False, True):
    compile_for_sm90(gated_rms_norm_kernel, dict(o_ptr=f32, g_ptr=bf, w_ptr=f32, y_ptr=bf, idx_ptr=i32, eps="fp32"),
                     dict(HAS_INDEX=has_index, BR=16, BD=128))
for spec, bounded, state in ((False, True, f32), (True, False, bf)):
    ptx = compile_for_sm90(kda_recurrent_kernel, dict(y_ptr=f32, g_ptr=bf, b_ptr=bf, s_ptr=state, o_ptr=f32, a_log_ptr=f32,
                           dt_bias_ptr=f32, idx_ptr=i32, spec_ptr=i32, acc_ptr=i32, lower_bound="fp32", scale="fp32"),
                           dict(M=4 if spec else 1, K=128, V=128, BV=32, IS_SPEC=spec, BOUNDED=bounded))
    # The state tile must move in 16-byte accesses (the kernel is bound by state traffic).
    assert re.search(r"ld\.global[^\n]*\.v4", ptx) and re.search(r"st\.global[^\n]*\.v4", ptx), "state not vectorized"
print("ok")
'''


def test_kernels_compile_for_sm90_without_a_gpu():
    """Triton's compiled mode (not the interpreter) accepts every kernel, ptxas included, and the
    recurrent state moves in 16-byte vectors: catches compile-only errors before a GPU run."""
    run_compiled(["-c", _COMPILE_ALL], timeout=300)
