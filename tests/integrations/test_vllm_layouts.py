"""The plugin's step (integrations/vllm/kdaserve_vllm/gdn_step.py) on vLLM's exact layouts, without
vLLM: inputs as strided views of vLLM's fused projection with CUDA-graph padding rows past the real
tokens, metadata shaped as vLLM's GDNAttentionMetadata (padding slots -1, slot 0 the null slot), a
mixed step, a padded decode step and a ragged speculative verify. Each must equal the same step on
contiguous, unpadded copies (bit for bit through the Triton kernels; within 1e-6 through the torch
reference, whose matmuls may pick other kernels for strided operands), write no padding row and
touch no slot outside the step. In the interpreter on the CPU (fp32, small) and, marked gpu,
bf16 at Kimi-Linear's head size on the GPU (flash prefill, fused decode and verify)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations" / "vllm"))

from kdaserve.backends import KDABackendChoice, LayerSettings, Machine, resolve_kda_backends  # noqa: E402
from kdaserve.ops.kda.types import KDACache  # noqa: E402
from kdaserve.testing import assert_rel_close, assert_slots_untouched  # noqa: E402
from kdaserve.testing.inputs import make_kda_weights  # noqa: E402
from kdaserve_vllm.gdn_step import run_gdn_step  # noqa: E402

PAD_ROWS = 5      # CUDA-graph padding past the real tokens
SLOTS = 12


def _metadata(kind: str, dev, S: int) -> tuple[SimpleNamespace, int]:
    """(vLLM-shaped metadata, real tokens). Slots 1..: a step's sequences; -1 pads a decode batch."""
    i32 = dict(dtype=torch.int32, device=dev)
    none = dict(spec_sequence_masks=None, spec_token_indx=None, non_spec_token_indx=None, num_spec_decodes=0,
                spec_state_indices_tensor=None, spec_query_start_loc=None, num_accepted_tokens=None,
                num_spec_decode_tokens=0)
    if kind == "mixed":   # vLLM puts decodes first: 2 decodes (1 token each, with state), 2 prefills
        lens = [1, 1, 37, 20]
        cu = torch.tensor([0, 1, 2, 39, 59], **i32)
        m = SimpleNamespace(**none, num_prefills=2, num_decodes=2, num_actual_tokens=59, non_spec_query_start_loc=cu,
                            non_spec_state_indices_tensor=torch.tensor([3, 5, 7, 2, -1, -1], **i32),
                            has_initial_state=torch.tensor([True, True, False, True], device=dev))
        return m, sum(lens)
    if kind == "decode":   # 3 real decodes in a graph batch of 8 (padding slots -1)
        m = SimpleNamespace(**none, num_prefills=0, num_decodes=3, num_actual_tokens=3,
                            non_spec_query_start_loc=torch.arange(9, **i32),
                            non_spec_state_indices_tensor=torch.tensor([4, 1, 9, -1, -1, -1, -1, -1], **i32),
                            has_initial_state=None)
        return m, 3
    # "verify": 3 sequences of S + 1 = 3 rows each in vLLM's state table, but vLLM found only one
    # draft for the second: 3 + 2 + 3 = 8 tokens (ragged)
    n, width = 3, S + 1
    m = SimpleNamespace(**none)
    m.spec_sequence_masks = torch.ones(n, dtype=torch.bool, device=dev)
    m.num_prefills, m.num_decodes, m.num_spec_decodes, m.num_actual_tokens = 0, 0, n, 8
    m.spec_state_indices_tensor = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [-1, -1, -1]], **i32)
    m.spec_query_start_loc = torch.tensor([0, 3, 5, 8], **i32)
    m.num_accepted_tokens = torch.tensor([1, 2, 1, 1], **i32)
    m.num_spec_decode_tokens = 8
    m.spec_token_indx = torch.arange(8, device=dev)
    m.non_spec_token_indx = torch.empty(0, dtype=torch.long, device=dev)
    m.non_spec_state_indices_tensor = torch.empty(0, **i32)
    m.non_spec_query_start_loc = None
    m.has_initial_state = None
    assert m.num_spec_decode_tokens != n * width
    return m, 8


def _check(kind: str, H: int, D: int, dtype, dev, prefill: str, decode: str, conv_layout: str, seed: int) -> None:
    """`exact`: the Triton kernels read each element where the strides say and do the same
    arithmetic, so they must agree bit for bit."""
    exact = prefill != "reference"
    S = 2 if kind == "verify" else 0
    g = torch.Generator(device="cpu").manual_seed(seed)
    weights = make_kda_weights(H, D, device=dev, generator=g)
    settings = LayerSettings(input_dtype=dtype, head_dim=D, lower_bound=weights.lower_bound, state_dtype=torch.float32,
                             conv_layout=conv_layout, num_spec_tokens=S, conv_width=4)
    choice = KDABackendChoice(prefill=prefill, decode=decode, conv_layout=conv_layout, num_spec_tokens=S)
    backends = resolve_kda_backends(choice, settings, H, Machine.detect(torch.device(dev)), log=False)
    m, T = _metadata(kind, dev, S)
    P = H * D
    rows = 3 + S
    # Kimi's fused projection: q|k|v, the output gate, f_a (D), beta (H), then padding columns.
    width = 3 * P + P + D + H + 7
    proj = torch.randn(T + PAD_ROWS, width, generator=g).to(dtype).to(dev)
    mixed_qkv, g2 = proj[:, : 3 * P], proj[:, 3 * P : 4 * P].view(-1, H, D)
    beta = proj[:, 4 * P + D : 4 * P + D + H].unsqueeze(0)
    g1 = torch.randn(1, T + PAD_ROWS, H, D, generator=g).to(dtype).to(dev)
    conv_shape = (SLOTS, rows, 3 * P) if conv_layout == "SD" else (SLOTS, 3 * P, rows)
    conv = torch.randn(conv_shape, generator=g).to(dtype).to(dev)
    rec = (torch.randn(SLOTS, H, D, D, generator=g) * 0.1).to(dev)

    def run(strided: bool):
        c, r = conv.clone(), rec.clone()
        if strided:
            args, out = (mixed_qkv, g1, g2, beta), torch.full((1, T + PAD_ROWS, H, D), float("nan"), dtype=dtype, device=dev)
        else:
            args = (mixed_qkv[:T].contiguous(), g1[:, :T].contiguous(), g2[:T].contiguous(), beta[:, :T].contiguous())
            out = torch.full((1, T, H, D), float("nan"), dtype=dtype, device=dev)
        run_gdn_step(m, backends, args[0], args[1], args[2], args[3], out, KDACache(c, r, conv_layout), weights, S)
        return out, c, r

    out_s, conv_s, rec_s = run(True)
    out_c, conv_c, rec_c = run(False)
    assert not out_s[0, :T].isnan().any() and out_s[0, T:].isnan().all(), f"{kind}: padding rows written or rows missed"
    assert torch.equal(conv_s, conv_c), f"{kind}: strided views changed the conv states"
    if exact:
        assert torch.equal(out_s[0, :T], out_c[0]), f"{kind}: strided views changed the output"
        assert torch.equal(rec_s, rec_c), f"{kind}: strided views changed the recurrent states"
    else:   # torch's own ops may pick other kernels for strided operands: rounding, not layout
        assert_rel_close(out_s[0, :T], out_c[0], 1e-6, f"{kind} output")
        assert_rel_close(rec_s, rec_c, 1e-6, f"{kind} recurrent states")
    used = sorted({int(s) for t in (m.non_spec_state_indices_tensor, m.spec_state_indices_tensor)
                   if t is not None for s in t.flatten().tolist() if s > 0})
    assert_slots_untouched(rec, rec_s, used, "recurrent_state")
    assert_slots_untouched(conv, conv_s, used, "conv_state")
    assert not torch.equal(rec_s[used], rec[used]), f"{kind}: the step wrote no state"


@pytest.mark.parametrize("kind", ["mixed", "decode", "verify"])
@pytest.mark.parametrize("backends", [("reference", "reference"), ("flash", "fused")], ids=["reference", "triton"])
def test_vllm_layouts_equal_contiguous_inputs(kind, backends):
    if backends[0] == "flash" and not (torch.cuda.is_available() or _interpreting()):
        pytest.skip("the Triton backends need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _check(kind, 2, 16, torch.float32, dev, *backends, "SD" if kind != "decode" else "DS", seed=7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["mixed", "decode", "verify"])
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_gpu_vllm_layouts_bf16_at_kimi_head_size(kind, conv_layout):
    _check(kind, 32, 128, torch.bfloat16, "cuda", "flash", "fused", conv_layout, seed=8)


def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


_NAN_CHECK = """
import sys, torch
sys.path.insert(0, {plugin!r})
from kdaserve_vllm.gdn_step import fail_on_nan
x = torch.randn(64, 4096, device="cuda")
if {poison}:
    x[17, 5] = float("nan")
fail_on_nan([x, torch.randn(1, 64, 8, device="cuda")], "layer 3 (tp rank 0 of 1, conv state layout SD): NaN")
torch.cuda.synchronize()
print("finished")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_the_nan_check_stops_the_process_without_a_host_sync():
    """On a GPU the plugin's NaN check is a device-side assertion (no host sync in the step): a NaN
    stops the process at its next synchronization; finite inputs pass. In subprocesses: a device
    assertion leaves the CUDA context unusable."""
    import subprocess
    import sys

    plugin = str(Path(__file__).resolve().parents[2] / "integrations" / "vllm")
    for poison in (False, True):
        done = subprocess.run([sys.executable, "-c", _NAN_CHECK.format(plugin=plugin, poison=poison)],
                              capture_output=True, text=True, timeout=300)
        if poison:
            assert done.returncode != 0 and "finished" not in done.stdout, done.stdout
            assert "device-side assert" in done.stderr or "Assertion" in done.stderr, done.stderr[-2000:]
        else:
            assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-2000:]
