"""The KDA layer under CUDA graphs (GPU only): a decode step captured once, then replayed as a decode
step and as the decode part of a mixed step (its prefills run eagerly), gives the eager results;
a weight refit after capture is seen by the replay (derived copies refreshed at the same address).

Activations are fp32 so that GEMMs of different row counts agree to ~1e-7 and the comparison can be
tight; bf16 numerics are parity's and the backends' own tests.
"""

import pytest
import torch

from kdaserve.backends import LayerSettings, Machine, check_backend
from kdaserve.backends.step import KDAStepMetadata
from kdaserve.layers.context import Context, reset_context, set_context
from kdaserve.layers.kda import KDALayer
from kdaserve.layers.kda_routing import make_kda_metadata
from kdaserve.layers.kda_weights import random_kda_checkpoint
from kdaserve.testing import assert_rel_close

pytestmark = pytest.mark.gpu

HID, H, D, N = 256, 4, 128, 6
DECODE_BACKENDS = ["chain", "fused", "adaptive", "fla"]


def _skip_unless_runnable(name):
    unmet = check_backend("decode", name, LayerSettings(input_dtype=torch.float32), Machine.detect("cuda"))
    if unmet:
        pytest.skip(f"{name} cannot run here: {'; '.join(unmet)}")


@pytest.fixture(autouse=True)
def _clean_context():
    yield
    reset_context()


def make_layer(decode_backend, seed=0):
    layer = KDALayer.build(HID, H, D, decode_backend=decode_backend, prefill_backend="auto", params_dtype=torch.float32,
                           device="cuda")
    layer.load_weights(random_kda_checkpoint(HID, H, D, dtype=torch.float32, device="cuda", seed=seed).items())
    spec = layer.cache_spec()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    slots = 3 * N + 2
    layer.bind_cache(torch.randn(slots, *spec["conv"][0], generator=g, device="cuda").to(spec["conv"][1]),
                     0.2 * torch.randn(slots, *spec["recurrent"][0], generator=g, device="cuda"))
    return layer


class CapturedDecode:
    """A decode step of N rows captured once on static buffers, the way the engine's runner does."""

    def __init__(self, layer):
        self.layer = layer
        self.x = torch.zeros(N, HID, device="cuda")
        self.slots = torch.zeros(N, dtype=torch.int32, device="cuda")  # all padding while capturing
        meta = KDAStepMetadata(num_decodes=N, num_decode_tokens=N, decode_state_indices=self.slots)
        self.step = layer.backends.build_for_capture(meta)
        set_context(Context(kda=self.step))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (autotuning, lazy init) outside the capture
            for _ in range(2):
                layer(self.x)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y = layer(self.x)

    def replay(self, x, slots):
        self.x.copy_(x)
        self.slots.copy_(torch.tensor(slots, dtype=torch.int32))
        set_context(Context(kda=self.step))
        self.graph.replay()
        return self.y.clone()


def snapshot(layer):
    return layer.conv_state.clone(), layer.recurrent_state.clone()


def restore(layer, snap):
    layer.conv_state.copy_(snap[0])
    layer.recurrent_state.copy_(snap[1])


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_replayed_decode_equals_eager(backend):
    _skip_unless_runnable(backend)
    layer = make_layer(backend)
    assert layer.decode_graph_capturable
    cap = CapturedDecode(layer)
    for step, slots in enumerate([[1, 2, 3, 4, 5, 6], [7, 0, 8, 2, 0, 9]]):  # a second batch with padding rows
        x = torch.randn(N, HID, device="cuda")
        before = snapshot(layer)
        y_graph = cap.replay(x, slots)
        after_graph = snapshot(layer)
        restore(layer, before)
        set_context(Context(kda=layer.backends.build_step(make_kda_metadata(decode_slots=slots, device="cuda"))))
        y_eager = layer(x)
        rows = torch.tensor([s > 0 for s in slots], device="cuda")
        assert_rel_close(y_graph[rows], y_eager[rows], 1e-6, f"{backend} step {step}: replayed vs eager output")
        assert_rel_close(after_graph[1], layer.recurrent_state, 1e-6, f"{backend} step {step}: states")
        # Conv states hold the projection outputs: equal up to GEMM rounding (cuBLAS may pick another
        # algorithm under capture), so compared like the rest rather than bit for bit.
        assert_rel_close(after_graph[0], layer.conv_state, 1e-6, f"{backend} step {step}: conv states")
        assert torch.equal(after_graph[1][0], before[1][0]), "the null slot was written"


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_replayed_decode_inside_a_mixed_step_equals_eager(backend):
    """Mixed step = the captured decode prefix replayed + the prefills run eagerly through _forward."""
    _skip_unless_runnable(backend)
    layer = make_layer(backend)
    cap = CapturedDecode(layer)
    dec_slots = [1, 2, 0, 4, 5, 6]
    pre_lens, pre_slots, pre_his = [70, 5, 129], [10, 11, 12], [True, False, True]
    mixed = make_kda_metadata(decode_slots=dec_slots, prefill_lens=pre_lens, prefill_slots=pre_slots,
                              prefill_has_initial_state=pre_his, device="cuda")
    x = torch.randn(mixed.num_tokens, HID, device="cuda")
    before = snapshot(layer)
    set_context(Context(kda=layer.backends.build_step(mixed)))
    y_eager = layer(x)
    eager = snapshot(layer)

    restore(layer, before)
    y_dec = cap.replay(x[:N], dec_slots)
    set_context(Context(kda=layer.backends.build_step(make_kda_metadata(
        prefill_lens=pre_lens, prefill_slots=pre_slots, prefill_has_initial_state=pre_his, device="cuda"))))
    y_pre = layer(x[N:])
    rows = torch.tensor([s > 0 for s in dec_slots] + [True] * sum(pre_lens), device="cuda")
    assert_rel_close(torch.cat([y_dec, y_pre])[rows], y_eager[rows], 1e-5, f"{backend}: graph+eager vs eager mixed step")
    assert_rel_close(layer.recurrent_state, eager[1], 1e-5, f"{backend}: states")
    assert_rel_close(layer.conv_state, eager[0], 1e-6, f"{backend}: conv states (GEMMs of other row counts)")


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_a_refit_after_capture_is_seen_by_the_replay(backend):
    _skip_unless_runnable(backend)
    layer = make_layer(backend)
    cap = CapturedDecode(layer)
    addrs = {n: t.data_ptr() for n, t in [("conv", layer.conv_weight), ("derived", layer.conv_weight_decode)] if t is not None}
    new = random_kda_checkpoint(HID, H, D, dtype=torch.float32, device="cuda", seed=9)
    layer.load_weights((k, v) for k, v in new.items() if k.endswith("conv1d.weight") or k in ("A_log", "dt_bias"))
    assert addrs == {n: t.data_ptr() for n, t in [("conv",
                                                   layer.conv_weight), ("derived", layer.conv_weight_decode)] if t is not None}
    slots = [3, 1, 4, 0, 5, 2]
    x = torch.randn(N, HID, device="cuda")
    before = snapshot(layer)
    y_graph = cap.replay(x, slots)
    restore(layer, before)
    fresh = make_layer(backend)  # built directly with the new weights, same initial pools
    fresh.load_weights((k, v) for k, v in new.items() if k.endswith("conv1d.weight") or k in ("A_log", "dt_bias"))
    fresh.bind_cache(*before)
    set_context(Context(kda=fresh.backends.build_step(make_kda_metadata(decode_slots=slots, device="cuda"))))
    y_fresh = fresh(x)
    rows = torch.tensor([s > 0 for s in slots], device="cuda")
    assert_rel_close(y_graph[rows], y_fresh[rows], 1e-6, f"{backend}: replay after refit vs a layer built with the new weights")
