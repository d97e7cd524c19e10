"""The external-kernel adapters (fla, flashkda, aiter) against the reference contract, without the
external packages.

The external packages are replaced by torch stand-ins of their documented entry points
(kda_fake_externals.py), and our Triton conv / norm run in Triton's interpreter: what is tested is
the adapters' glue. The real kernels are checked by tests/backends/test_adapters_gpu.py.
"""

import os

import pytest
import torch
from kda_fake_externals import install

from kdaserve.backends.adapters.aiter import chunk_tables, kda_decode_aiter, kda_prefill_aiter
from kdaserve.backends.adapters.fla import kda_decode_fla, kda_prefill_fla
from kdaserve.backends.adapters.flashkda import kda_prefill_flashkda
from kdaserve.backends.adapters.state_io import gather_states, scatter_states
from kdaserve.ops.kda.reference import kda_prefill_reference
from kdaserve.testing import make_kda_case, tolerance_for
from kdaserve.testing.properties import (
    check_decode_matches_reference,
    check_mixed_equals_alone,
    check_prefill_matches_reference,
    check_spec_resume,
    run_prefill,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the stand-ins run anywhere; our conv/norm on the GPU there

F32_TOL = tolerance_for(torch.float32)
BF16_TOL = tolerance_for(torch.bfloat16)


def spec_decode_case(N, S, *, pad_row=None, seed=0, **kw):
    """A verify step: S+1 tokens for each of N sequences, per-token slots, random acceptances."""
    case = make_kda_case([S + 1] * N, spec_tokens=S, seed=seed, device=DEV, **kw)
    g = torch.Generator().manual_seed(seed)
    free = [s for s in range(1, case.recurrent_state.shape[0]) if s not in case.state_indices.tolist()]
    spec = torch.tensor(free[: N * S], dtype=torch.int32).view(N, S)
    spec = torch.cat([case.state_indices.view(N, 1).cpu(), spec], 1)  # the resume slot first
    accepted = torch.randint(1, S + 2, (N,), generator=g, dtype=torch.int32)
    if pad_row is not None:
        case.state_indices[pad_row] = 0
        spec[pad_row, 0] = 0  # a padding row: its first slot <= 0; the rest must not be written either
        accepted[pad_row] = 0  # padding may carry anything
    return case, dict(spec_state_indices=spec.to(case.qkv.device), num_accepted_tokens=accepted.to(case.qkv.device))


# ---- state gather / scatter -------------------------------------------------------------------


def test_scatter_writes_real_rows_and_leaves_every_other_slot_bit_exact():
    pool = torch.randn(6, 2, 3)
    pool[0, 0, 0] = float("nan")  # the null slot's bits survive, NaN payload included
    before = pool.clone()
    slots = torch.tensor([4, 0, 2, -1], dtype=torch.int32)
    dense = gather_states(pool, slots, keep=torch.tensor([True, True, False, True]))
    assert torch.equal(dense[0], pool[4]) and torch.equal(dense[2], torch.zeros(2, 3))
    scatter_states(pool, slots, torch.full((4, 2, 3), 7.0), slots > 0)
    assert (pool[4] == 7).all() and (pool[2] == 7).all()
    for s in (0, 1, 3, 5):
        assert torch.equal(pool[s].view(torch.int32), before[s].view(torch.int32))


# ---- fla ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate, layout", [("bounded", "SD"), ("unbounded", "DS")])
def test_fla_prefill_matches_the_reference(monkeypatch, gate, layout):
    install(monkeypatch, "fla")
    case = make_kda_case([5, 1, 9, 3], device=DEV, H=2, D=16, gate=gate, conv_layout=layout, slow_decay_heads=1, seed=1)
    check_prefill_matches_reference(kda_prefill_fla, case, F32_TOL)
    check_mixed_equals_alone(kda_prefill_fla, [4, 7, 2], F32_TOL, H=2, D=16, seed=2, device=DEV)


def test_fla_prefill_with_bf16_state_rounds_like_the_pool(monkeypatch):
    install(monkeypatch, "fla")
    case = make_kda_case([6, 3], device=DEV, H=2, D=16, state_dtype=torch.bfloat16, has_initial_state=True, seed=3)
    check_prefill_matches_reference(kda_prefill_fla, case, tolerance_for(torch.float32, torch.bfloat16))


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_fla_decode_matches_the_reference_with_padding(monkeypatch, layout):
    install(monkeypatch, "fla")
    case = make_kda_case([1, 1, 1, 1], device=DEV, H=2, D=16, conv_layout=layout, seed=4)
    case.state_indices[2] = 0  # CUDA-graph padding: nothing read, nothing written, slot 0 untouched
    check_decode_matches_reference(kda_decode_fla, case, F32_TOL)


def test_fla_speculative_verify_matches_the_reference(monkeypatch):
    install(monkeypatch, "fla")
    case, spec = spec_decode_case(3, 2, pad_row=1, H=2, D=16, seed=5)
    check_decode_matches_reference(kda_decode_fla, case, F32_TOL, **spec)


@pytest.mark.parametrize("accepted", [1, 3])
def test_fla_verify_then_resume_equals_the_accepted_only_run(monkeypatch, accepted):
    install(monkeypatch, "fla")
    check_spec_resume(kda_prefill_fla, kda_decode_fla, accepted, F32_TOL, S=2, H=2, D=16, device=DEV)


def test_fla_adapter_keeps_fla_on_its_own_kernels():
    assert os.environ.get("FLA_FLASH_KDA") == "0"


# ---- flashkda (bf16, head 128: bf16 loads/stores are fine in the interpreter, no tl.dot here) ----


def test_flashkda_prefill_matches_the_reference(monkeypatch):
    install(monkeypatch, "flash_kda")
    case = make_kda_case([7, 2, 4], device=DEV, H=1, D=128, dtype=torch.bfloat16, seed=6)
    check_prefill_matches_reference(kda_prefill_flashkda, case, BF16_TOL)


def test_flashkda_refuses_the_unbounded_gate(monkeypatch):
    install(monkeypatch, "flash_kda")
    case = make_kda_case([3], device=DEV, H=1, D=128, dtype=torch.bfloat16, gate="unbounded")
    with pytest.raises(ValueError, match="bounded gate only"):
        run_prefill(kda_prefill_flashkda, case)


# ---- aiter --------------------------------------------------------------------------------------


def test_aiter_chunk_tables_are_built_on_the_host():
    ci, co = chunk_tables(torch.tensor([0, 64, 65, 200], dtype=torch.int32), "cpu")
    assert ci.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2]] and co.tolist() == [0, 1, 2, 5]


def test_aiter_prefill_matches_the_reference(monkeypatch):
    install(monkeypatch, "aiter")
    case = make_kda_case([70, 3, 5], device=DEV, H=1, D=128, dtype=torch.bfloat16, conv_layout="DS", seed=7)
    check_prefill_matches_reference(kda_prefill_aiter, case, BF16_TOL, chunk_size=64)


def test_aiter_decode_and_verify_match_the_reference(monkeypatch):
    install(monkeypatch, "aiter")
    case = make_kda_case([1, 1, 1], device=DEV, H=1, D=128, dtype=torch.bfloat16, seed=8)
    case.state_indices[0] = 0
    check_decode_matches_reference(kda_decode_aiter, case, BF16_TOL)
    case, spec = spec_decode_case(3, 1, pad_row=2, H=1, D=128, dtype=torch.bfloat16, seed=9)
    check_decode_matches_reference(kda_decode_aiter, case, BF16_TOL, **spec)


def test_aiter_refuses_an_old_api(monkeypatch):
    install(monkeypatch, "aiter")
    import sys

    monkeypatch.setattr(sys.modules["aiter.ops.triton.attention.kda"], "fused_recurrent_kda", lambda q, k, v, g, beta: None)
    case = make_kda_case([1], device=DEV, H=1, D=128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="pad_slot_guard"):
        check_decode_matches_reference(kda_decode_aiter, case, BF16_TOL)


def test_reference_prefill_is_exercised():  # keeps the import honest when the module is trimmed
    assert callable(kda_prefill_reference)
