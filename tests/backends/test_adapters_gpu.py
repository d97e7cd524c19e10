"""External-kernel adapters with the real packages on a GPU: the same property checks as every
backend (kdaserve.testing.properties), bf16 inputs, head size 128. Skipped where the backend's
requirements are not met (the reason lists them)."""

import pytest
import torch

from kdaserve.backends import LayerSettings, Machine, check_backend, resolve_backend
from kdaserve.testing import make_kda_case, tolerance_for
from kdaserve.testing.properties import (
    check_decode_matches_reference,
    check_mixed_equals_alone,
    check_prefill_matches_reference,
    check_spec_resume,
    check_split_prefill,
)

pytestmark = pytest.mark.gpu

BF16 = dict(dtype=torch.bfloat16, device="cuda", H=4, D=128)
TOL = tolerance_for(torch.bfloat16)


def backend(phase, name, **settings):
    s = LayerSettings(**settings)
    unmet = check_backend(phase, name, s, Machine.detect("cuda"))
    if unmet:
        pytest.skip(f"{phase} {name} cannot run here: {'; '.join(unmet)}")
    return resolve_backend(phase, name, s, Machine.detect("cuda")).fn


def spec_case(N, S, pad_row, seed, **kw):
    case = make_kda_case([S + 1] * N, spec_tokens=S, seed=seed, **kw)
    used = set(case.state_indices.tolist())
    free = [s for s in range(1, case.recurrent_state.shape[0]) if s not in used][: N * S]
    spec = torch.cat([case.state_indices.view(N, 1).cpu(), torch.tensor(free, dtype=torch.int32).view(N, S)], 1)
    accepted = torch.randint(1, S + 2, (N,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    case.state_indices[pad_row] = 0
    spec[pad_row, 0], accepted[pad_row] = 0, 0  # padding: first slot <= 0 (its other slots stay untouched)
    return case, dict(spec_state_indices=spec.cuda(), num_accepted_tokens=accepted.cuda())


@pytest.mark.parametrize("name", ["fla", "flashkda", "aiter"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_prefill_adapter_matches_the_reference(name, layout):
    fn = backend("prefill", name, conv_layout=layout)
    case = make_kda_case([300, 1, 64, 1000, 17], conv_layout=layout, slow_decay_heads=1, seed=1, **BF16)
    check_prefill_matches_reference(fn, case, TOL, chunk_size=64)
    check_mixed_equals_alone(fn, [130, 7, 64], TOL, conv_layout=layout, seed=2, **BF16)
    check_split_prefill(fn, 200, 77, TOL, seed=3, **BF16)


@pytest.mark.parametrize("name", ["fla", "flashkda"])
def test_prefill_adapter_with_bf16_state(name):
    fn = backend("prefill", name, state_dtype=torch.bfloat16)
    case = make_kda_case([500, 33], state_dtype=torch.bfloat16, seed=4, **BF16)
    check_prefill_matches_reference(fn, case, tolerance_for(torch.bfloat16, torch.bfloat16), chunk_size=64)


def test_fla_prefill_unbounded_gate():
    fn = backend("prefill", "fla", lower_bound=None)
    check_prefill_matches_reference(fn, make_kda_case([256, 9], gate="unbounded", seed=5, **BF16), TOL, chunk_size=64)


@pytest.mark.parametrize("name", ["fla", "aiter"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_decode_adapter_matches_the_reference(name, layout):
    fn = backend("decode", name, conv_layout=layout)
    case = make_kda_case([1] * 9, conv_layout=layout, seed=6, **BF16)
    case.state_indices[3] = 0
    check_decode_matches_reference(fn, case, TOL)
    case, spec = spec_case(5, 2, pad_row=1, seed=7, conv_layout=layout, **BF16)
    check_decode_matches_reference(fn, case, TOL, **spec)


@pytest.mark.parametrize("name", ["fla", "aiter"])
@pytest.mark.parametrize("accepted", [1, 2, 4])
def test_decode_adapter_verify_then_resume(name, accepted):
    dec = backend("decode", name, num_spec_tokens=3)
    pre = backend("prefill", "fla" if name == "fla" else "aiter", num_spec_tokens=3)
    check_spec_resume(pre, dec, accepted, TOL, S=3, **BF16)


def test_fla_decode_is_graph_capturable():
    fn = backend("decode", "fla")
    case = make_kda_case([1] * 8, seed=8, **BF16)
    args = case.decode_args()
    out = case.new_out()
    fn(out=out, **args)  # warm-up: compiles and autotunes
    pools = case.conv_state.clone(), case.recurrent_state.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(out=out, **args)
    case.conv_state.copy_(pools[0])
    case.recurrent_state.copy_(pools[1])
    out.fill_(float("nan"))
    graph.replay()
    eager = case.clone()
    eager.conv_state.copy_(pools[0])
    eager.recurrent_state.copy_(pools[1])
    eager_out = eager.new_out()
    fn(out=eager_out, **eager.decode_args())
    assert torch.equal(out, eager_out) and torch.equal(case.recurrent_state, eager.recurrent_state)
