"""The `stream` launch shape of the fused decode (stream_kernel.py: one program per head streaming
its state in [BV, K] tiles, for bandwidth-bound steps) against the torch reference.

CPU: Triton's interpreter (fp32/fp16 inputs, tiny heads), every way of keeping tiles in flight
(register prefetch 0/1/2, the cp.async pipeline's stages) forced at tiny shapes, plus a compile for
sm_90 (registers, spills, 16-byte state accesses). GPU: bf16, real head sizes, many waves, CUDA
graphs, agreement with chain.
"""

import functools

import pytest
import torch
from compiled_mode import run_compiled

from kdaserve.ops.kda.fused import FusedDecodeConfig, kda_decode_fused, launch_fused_decode
from kdaserve.ops.kda.fused import decode as fused_decode
from kdaserve.ops.kda.fused.decode import default_config
from kdaserve.testing import make_kda_case, tolerance_for
from kdaserve.testing.properties import (
    check_decode_agrees,
    check_decode_matches_reference,
    run_decode,
    with_fused_decode_layout,
    with_padding_rows,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(H=2, D=16, device=DEV)
STREAMS = {  # D=16: 4 or 2 tiles per head
    "pf0": FusedDecodeConfig(4, 2, stream=True, prefetch=0),
    "pf1": FusedDecodeConfig(4, 2, stream=True, prefetch=1),
    "pf2": FusedDecodeConfig(4, 2, stream=True, prefetch=2),
    "s2": FusedDecodeConfig(8, 2, stream=True, stages=2),
    "s3": FusedDecodeConfig(4, 2, stream=True, stages=3),
    "s3_winregs": FusedDecodeConfig(4, 2, window_regs=True, stream=True, stages=3),
    "s3_pf1": FusedDecodeConfig(4, 2, stream=True, stages=3, prefetch=1),  # tiles 0, 1 early, then the pipeline
    "s2_pf2": FusedDecodeConfig(8, 2, stream=True, stages=2, prefetch=2),  # 2 tiles: all early, no pipeline left
}


def _fn(name):
    return functools.partial(launch_fused_decode, STREAMS[name])



@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("name", list(STREAMS))
def test_stream_shapes_match_reference(layout, name):
    """Output, state and conv state match the reference; other slots bit-for-bit; padding rows
    (slot 0 and -1) stay NaN and touch nothing."""
    case = make_kda_case([1] * 5, conv_layout=layout, gate="unbounded", slow_decay_heads=1, seed=2, **SMALL)
    check_decode_matches_reference(_fn(name), with_padding_rows(case, 1, 3), 1e-5)


@pytest.mark.parametrize("name", ["pf1", "s3"])
def test_stream_bounded_gate_decode_layout_and_draft_sized_pool(name):
    """Bounded gate with the derived conv weight; a conv pool sized for 2 drafts (5 rows: all
    rows shift by one, the older ones re-read)."""
    for layout in ("SD", "DS"):
        case = make_kda_case([1] * 3, spec_tokens=2, conv_layout=layout, gate="bounded", seed=5, **SMALL)
        check_decode_matches_reference(_fn(name), with_padding_rows(with_fused_decode_layout(case), 2), 1e-5)


def test_stream_bf16_state_and_fp16_inputs():
    case = make_kda_case([1] * 4, state_dtype=torch.bfloat16, seed=4, **SMALL)
    check_decode_matches_reference(_fn("s3"), case, tolerance_for(torch.float32, torch.bfloat16))
    case = make_kda_case([1] * 4, dtype=torch.float16, strided=False, seed=3, **SMALL)
    check_decode_matches_reference(_fn("pf1"), case, tolerance_for(torch.float16))


def test_stream_consecutive_steps():
    """Three steps on the same pools (fresh tokens): the conv window and state written by one step
    are what the next reads."""
    case = with_padding_rows(make_kda_case([1] * 4, seed=40, **SMALL), 2)
    for step in range(3):
        fresh = make_kda_case([1] * 4, seed=41 + step, **SMALL)
        case.proj.copy_(fresh.proj)
        case.forget_logits.copy_(fresh.forget_logits)
        case.output_gate_logits.copy_(fresh.output_gate_logits)
        check_decode_matches_reference(_fn("s3" if step % 2 else "pf2"), case, 1e-5)


def test_default_rule_streams_only_large_plain_steps(monkeypatch):
    big = fused_decode.STREAM_FROM_HEADS
    assert big > 0
    for state_bytes in (4, 2):
        assert default_config(128, 1, big, state_bytes).stream
        assert not default_config(128, 1, big // 2, state_bytes).stream
        assert not default_config(128, 4, 4 * big, state_bytes).stream, "verify never streams"
        assert not default_config(128, 1, 4 * big, state_bytes, verify=True).stream, "a verify without drafts never streams"
    assert default_config(16, 1, big).block_v <= 16
    monkeypatch.setattr(fused_decode, "STREAM_FROM_HEADS", 0)
    assert not default_config(128, 1, 65536).stream, "0 disables the stream shape"


def test_stream_refuses_verify_and_bad_pipelines():
    case = make_kda_case([1] * 2, seed=8, **SMALL)
    args, out = case.decode_args(), case.new_out()
    for cfg, msg in ((FusedDecodeConfig(4, 2, stream=True, prefetch=3), "prefetch"),
                     (FusedDecodeConfig(4, 2, stream=True, stages=1), "stages")):
        with pytest.raises(ValueError, match=msg):
            launch_fused_decode(cfg, out=out, **args)
    spec_case = make_kda_case([2, 2], spec_tokens=1, extra_slots=8, seed=9, **SMALL)
    used = set(spec_case.state_indices.tolist())
    spec = torch.tensor([s for s in range(1, 20) if s not in used][:4], dtype=torch.int32).view(2, 2).to(DEV)
    accepted = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="plain decode only"):
        launch_fused_decode(STREAMS["s3"], out=spec_case.new_out(), **spec_case.decode_args(spec, accepted))


@pytest.mark.parametrize("backend", ["fused", "adaptive"])
def test_verify_without_drafts_never_streams(monkeypatch, backend):
    """A speculative verify with no drafts (spec_state_indices [N, 1]) has one token per sequence
    but keeps its state in the spec slots: with the stream rule lowered to cover this step, the
    default path must still take a verify shape and match the reference (the stream kernel reads
    state_indices' slots: output and spec-slot state were wrong before the fix)."""
    from kdaserve.ops.kda.adaptive import kda_decode_adaptive

    monkeypatch.setattr(fused_decode, "STREAM_FROM_HEADS", 1)
    N = 3
    case = with_fused_decode_layout(make_kda_case([1] * N, spec_tokens=0, extra_slots=2 * N + 2, seed=11, **SMALL))
    free = [s for s in range(1, case.recurrent_state.shape[0]) if s not in set(case.state_indices.tolist())]
    spec = torch.tensor(free[:N], dtype=torch.int32, device=DEV).view(N, 1)
    accepted = torch.ones(N, dtype=torch.int32, device=DEV)
    fn = kda_decode_fused if backend == "fused" else kda_decode_adaptive
    check_decode_matches_reference(fn, case, tolerance_for(torch.float32), spec_state_indices=spec,
                                   num_accepted_tokens=accepted)


# ---------------------------------------------------------------- CPU: compiled for sm_90

_COMPILE = r'''
import re
from kdaserve.ops.kda.fused import FusedDecodeConfig as C
from tools.compile_check_fused import fused_kernel
from kdaserve.ops.kda.fused.decode import STREAM_BF16, STREAM_FP32
from tools.sm90_compile import ptxas_report

for cfg, state, D in ((STREAM_FP32, "*fp32", 128), (STREAM_BF16, "*bf16", 128), (C(32, 4, stream=True, prefetch=1), "*fp32", 128),
                      (C(32, 4, stream=True, prefetch=0), "*bf16", 128),
                      (C(8, 4, stream=True, stages=5, prefetch=2), "*fp32", 128),
                      (STREAM_FP32, "*fp32", 16)):
    k = fused_kernel(cfg, state, D=D)
    ptx, rep = k.asm["ptx"], ptxas_report(k)
    assert "spill_st=0" in rep, (cfg, rep)
    # The state moves in 16-byte accesses: cp.async of 16 bytes (pipeline) or ld.global.v4, and st.global.v4.
    if D == 128:
        pattern = r"cp\.async\.cg\.shared\.global[^\n]*0x10" if cfg.stages else r"ld\.global[^\n]*\.v4"
        loads = re.search(pattern, ptx)
        assert loads and re.search(r"st\.global[^\n]*\.v4", ptx), ("state not vectorized", cfg)
    # No workspace, no meeting: neither atomics nor polling.
    assert "atom." not in ptx and "ld.volatile" not in ptx, cfg
print("ok")
'''


def test_stream_compiles_for_sm90_without_spills():
    """Compiled mode (not the interpreter), ptxas included, for the default stream shapes and the
    register-prefetch variants: no spills, 16-byte state accesses, no atomics or polling."""
    run_compiled(["-c", _COMPILE], timeout=600)


# ---------------------------------------------------------------- GPU only

GPU_STREAMS = {
    "default_fp32": fused_decode.STREAM_FP32, "default_bf16": fused_decode.STREAM_BF16,
    "bv32_w4_pf0": FusedDecodeConfig(32, 4, stream=True, prefetch=0),
    "bv16_w4_pf1": FusedDecodeConfig(16, 4, stream=True, prefetch=1),
    "bv32_w4_s3": FusedDecodeConfig(32, 4, stream=True, stages=3),
    "bv8_w4_s5": FusedDecodeConfig(8, 4, stream=True, stages=5),
    "bv8_w4_s5_pf2": FusedDecodeConfig(8, 4, stream=True, stages=5, prefetch=2),
    "bv16_w2_s4": FusedDecodeConfig(16, 2, stream=True, stages=4),
}



@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_STREAMS))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_stream_shapes_over_many_waves(name, state_dtype):
    """300 sequences x 32 heads (9600 programs, many waves), two padding rows, both gates across
    the two layouts: every shape of the sweep equals the reference."""
    for layout, gate in (("SD", "bounded"), ("DS", "unbounded")):
        case = make_kda_case([1] * 300, H=32, D=128, dtype=torch.bfloat16, state_dtype=state_dtype, conv_layout=layout,
                             gate=gate, extra_slots=4, seed=27, device="cuda")
        fn = functools.partial(launch_fused_decode, GPU_STREAMS[name])
        check_decode_matches_reference(fn, with_fused_decode_layout(with_padding_rows(case, 7, 150)),
                                       tolerance_for(torch.bfloat16, state_dtype))


@pytest.mark.gpu
def test_gpu_default_stream_matches_chain():
    chain = pytest.importorskip("kdaserve.ops.kda.chain").kda_decode_chain
    case = make_kda_case([1] * 128, H=16, D=128, dtype=torch.bfloat16, seed=23, device="cuda")  # 2048 heads
    assert default_config(128, 1, 128 * 16).stream
    check_decode_agrees(kda_decode_fused, chain, with_fused_decode_layout(with_padding_rows(case, 5)),
                        tolerance_for(torch.bfloat16),
                        "stream vs chain")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default_fp32", "bv16_w4_pf1"])
def test_gpu_stream_cuda_graph_replay_equals_eager(name):
    """Capture one step, replay it on fresh inputs, a new slot order and a padding row: bit for bit
    the eager result on a copy of the pools."""
    fn = functools.partial(launch_fused_decode, GPU_STREAMS[name])
    N, H = 24, 16
    case = with_fused_decode_layout(make_kda_case([1] * N, H=H, D=128, dtype=torch.bfloat16, seed=24, device="cuda"))
    out = case.new_out()
    args = dict(out=out, **case.decode_args())
    fn(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(**args)
    for step in range(3):
        fresh = make_kda_case([1] * N, H=H, D=128, dtype=torch.bfloat16, seed=100 + step, device="cuda")
        case.proj.copy_(fresh.proj)
        case.forget_logits.copy_(fresh.forget_logits)
        case.output_gate_logits.copy_(fresh.output_gate_logits)
        case.state_indices.copy_(case.state_indices.flip(0))
        case.state_indices[step] = 0
        eager = case.clone()
        out_e = run_decode(fn, eager)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out.isnan(), out_e.isnan()), f"step {step}: padding rows differ"
        assert torch.equal(out.nan_to_num(), out_e.nan_to_num()), f"step {step}: graph output differs from eager"
        assert torch.equal(case.recurrent_state, eager.recurrent_state), f"step {step}: graph state differs"
        assert torch.equal(case.conv_state, eager.conv_state), f"step {step}: graph conv state differs"
