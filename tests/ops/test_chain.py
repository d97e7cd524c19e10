"""The `chain` decode backend (conv update -> recurrence -> gated norm) held to the decode contract."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from kdaserve.ops.chain import kda_decode_chain  # noqa: E402
from kdaserve.ops.reference import kda_decode_reference, kda_prefill_reference  # noqa: E402
from kdaserve.testing import make_kda_case, tolerance_for  # noqa: E402
from kdaserve.testing.properties import check_decode_matches_reference, check_spec_resume, run_decode  # noqa: E402

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


@pytest.mark.parametrize("accepted,layout", [(1, "SD"), (2, "DS"), (4, "SD")])
def test_spec_resume_equals_accepted_only_run(accepted, layout):
    check_spec_resume(kda_prefill_reference, kda_decode_chain, accepted, tolerance_for(torch.float32), S=3,
                      H=1, D=16, conv_layout=layout, device=DEV)


def test_rejects_bad_metadata():
    case = make_kda_case([1] * 2, H=1, D=16, seed=33)
    with pytest.raises(ValueError, match="one token per sequence"):
        kda_decode_chain(
            out=case.new_out(), **{**case.decode_args(), "state_indices": case.state_indices[:1]})


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
