"""Ling-3's gate rounding (KDAWeights.gate_dtype): every one of kdaserve's KDA kernels rounds the
per-channel log-decay to the layer's activation dtype before using it, as the torch reference does
(and as transformers' BailingHybridForgetGate casts its output: tests/models/test_bailing_hybrid.py).
fp32 inputs with the gate rounded to bf16 (fp16 on the CPU: Triton 3.6's interpreter converts fp32
to bf16 without round-to-nearest, fp16 correctly), so the kernels' own rounding is far below the
rounding's effect: each kernel matches the rounding reference within 5e-6 (measured 2-4e-7 for
flash) and moves by more than 2e-5 without the rounding (measured 4.6-4.9e-5 for flash in fp16,
9-14e-5 for the decode kernels). On the CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kdaserve.ops.kda.chain import kda_decode_chain
from kdaserve.ops.kda.flash import kda_prefill_flash
from kdaserve.ops.kda.fused import FusedDecodeConfig, kda_decode_fused, launch_fused_decode
from kdaserve.ops.kda.reference import kda_gate
from kdaserve.testing import make_kda_case, rel_rms
from kdaserve.testing.properties import (
    check_decode_matches_reference,
    check_prefill_matches_reference,
    run_decode,
    run_prefill,
    with_fused_decode_layout,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GATE_DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16


STREAM = functools.partial(launch_fused_decode, FusedDecodeConfig(4, 2, stream=True, stages=2))   # large batches


def _rounded(case):
    case.weights = dataclasses.replace(case.weights, gate_dtype=GATE_DTYPE)
    return case


def test_the_reference_gate_is_the_fp32_gate_rounded():
    g = torch.Generator().manual_seed(0)
    logits, A_log, dt_bias = torch.randn(9, 2, 16, generator=g) * 3, torch.randn(2, generator=g), torch.randn(2, 16, generator=g)
    for lb in (-5.0, None):
        exact = kda_gate(logits, A_log, dt_bias, lb)
        rounded = kda_gate(logits, A_log, dt_bias, lb, torch.bfloat16)
        assert rounded.dtype == torch.float32 and torch.equal(rounded, exact.to(torch.bfloat16).float())
        assert not torch.equal(rounded, exact)


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_flash_prefill_rounds_the_gate(gate):
    case = _rounded(make_kda_case([5, 40, 17], H=2, D=16, gate=gate, has_initial_state=[True, False, True], seed=7,
                                  device=DEV))
    plain, again = case.clone(), case.clone()   # before the check updates the case's states in place
    plain.weights = dataclasses.replace(case.weights, gate_dtype=None)
    check_prefill_matches_reference(kda_prefill_flash, case, 5e-6)
    assert rel_rms(run_prefill(kda_prefill_flash, plain), run_prefill(kda_prefill_flash, again)) > 2e-5


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("decode", [kda_decode_fused, STREAM, kda_decode_chain], ids=["fused", "fused-stream", "chain"])
def test_decode_kernels_round_the_gate(decode, gate):
    case = _rounded(make_kda_case([1] * 5, H=2, D=16, gate=gate, seed=8, device=DEV))
    if decode is not kda_decode_chain:
        case = with_fused_decode_layout(case)
    plain, again = case.clone(), case.clone()
    plain.weights = dataclasses.replace(case.weights, gate_dtype=None)
    check_decode_matches_reference(decode, case, 5e-6)
    assert rel_rms(run_decode(decode, plain), run_decode(decode, again)) > 2e-5
