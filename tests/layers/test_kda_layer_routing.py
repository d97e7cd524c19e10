"""How the KDA layer routes a step: a mixed step equals its sequences run separately, speculative
steps take the recurrent (decode) path, a step without metadata touches no state, and the layer's
projections feed the core in the checkpoint's column order."""

import dataclasses

import pytest
import torch

from kdaserve.backends.step import KDAStepMetadata
from kdaserve.layers.context import Context, reset_context, set_context
from kdaserve.layers.kda import KDALayer
from kdaserve.layers.kda_routing import make_kda_metadata, run_kda_step, step_route
from kdaserve.layers.kda_weights import random_kda_checkpoint
from kdaserve.ops.kda.reference import kda_decode_reference, kda_prefill_reference
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, PrefillSeqs
from kdaserve.testing import assert_rel_close, assert_slots_untouched

HID, H, D, W = 32, 2, 8, 4
F64 = dict(params_dtype=torch.float64, state_dtype=torch.float64)


@pytest.fixture(autouse=True)
def _clean_context():
    yield
    reset_context()


def make_layer(num_spec_tokens=0, conv_layout="SD", lower_bound=-5.0, num_slots=12):
    layer = KDALayer.build(HID, H, D, conv_kernel_size=W, num_spec_tokens=num_spec_tokens, conv_layout=conv_layout,
                     lower_bound=lower_bound, **F64)
    gate = "bounded" if lower_bound is not None else "unbounded"
    layer.load_weights(random_kda_checkpoint(HID, H, D, conv_width=W, gate=gate, dtype=torch.float64, seed=2).items())
    g = torch.Generator().manual_seed(3)
    spec = layer.cache_spec()
    layer.bind_cache(torch.randn(num_slots, *spec["conv"][0], generator=g).double(),
                     0.2 * torch.randn(num_slots, *spec["recurrent"][0], generator=g).double())
    return layer


def use(layer, meta):
    """The step as the model runner sets it: built once by the layers' pair."""
    set_context(Context(kda=layer.backends.build_step(meta)))


def run(layer, meta, x):
    use(layer, meta)
    return layer(x)


def spy(layer):
    """Record which backend ran with which keyword arguments, still running the real one."""
    calls = []

    def wrap(kind, fn):
        def f(*args, **kw):
            calls.append((kind, args))
            return fn(*args, **kw)

        return f

    b = layer.backends
    layer.backends = dataclasses.replace(b, prefill=dataclasses.replace(b.prefill, fn=wrap("prefill", b.prefill.fn)),
                                         decode=dataclasses.replace(b.decode, fn=wrap("decode", b.decode.fn)))
    return calls


@pytest.mark.parametrize("conv_layout, gate_lb", [("SD", -5.0), ("DS", None)])
def test_mixed_step_equals_its_sequences_run_separately(conv_layout, gate_lb):
    """Decodes (one of them padding, slot 0) then prefills with and without history, in one step
    == each sequence in a step of its own kind."""
    layer = make_layer(conv_layout=conv_layout, lower_bound=gate_lb)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    dec_slots, pre_lens, pre_slots, pre_his = [5, 0, 2], [6, 1, 9], [7, 3, 10], [True, False, True]
    meta = make_kda_metadata(decode_slots=dec_slots, prefill_lens=pre_lens, prefill_slots=pre_slots,
                             prefill_has_initial_state=pre_his)
    x = torch.randn(meta.num_tokens, HID, dtype=torch.float64)
    # Once: the same core inputs for every run (GEMMs differ by T).
    qkv, beta, forget_logits, output_gate_logits = layer.project(x)
    calls = spy(layer)

    def core(meta, t0, t1):
        use(layer, meta)
        out = torch.full((t1 - t0, H, D), float("nan"), dtype=torch.float64)
        layer._forward(qkv[t0:t1], forget_logits[t0:t1], beta[t0:t1], output_gate_logits[t0:t1], out)
        return out

    y_mixed = core(meta, 0, meta.num_tokens)
    assert [c[0] for c in calls] == ["decode", "prefill"]
    assert step_route(layer.backends.build_step(meta)) == "mixed"
    mixed_conv, mixed_rec = layer.conv_state.clone(), layer.recurrent_state.clone()

    layer.conv_state.copy_(conv0)
    layer.recurrent_state.copy_(rec0)
    t = 0
    for n, slot in enumerate(dec_slots):
        y = core(make_kda_metadata(decode_slots=[slot]), t, t + 1)
        if slot > 0:
            assert_rel_close(y, y_mixed[t : t + 1], 1e-12, f"decode {n} alone vs mixed")
        t += 1
    for n, (length, slot, his) in enumerate(zip(pre_lens, pre_slots, pre_his)):
        meta1 = make_kda_metadata(prefill_lens=[length], prefill_slots=[slot], prefill_has_initial_state=[his])
        y = core(meta1, t, t + length)
        assert_rel_close(y, y_mixed[t : t + length], 1e-12, f"prefill {n} alone vs mixed")
        t += length
    assert_rel_close(layer.recurrent_state, mixed_rec, 1e-12, "states alone vs mixed")
    assert torch.equal(layer.conv_state, mixed_conv), "conv states alone vs mixed"
    touched = [s for s in dec_slots + pre_slots if s > 0]
    assert_slots_untouched(rec0, mixed_rec, touched, "recurrent pool")
    assert_slots_untouched(conv0, mixed_conv, touched, "conv pool")


@pytest.mark.parametrize("with_prefill", [False, True])
def test_speculative_steps_take_the_recurrent_path(with_prefill):
    S = 2
    layer = make_layer(num_spec_tokens=S)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    spec_slots, accepted = [[3, 4, 5], [0, 0, 0], [6, 7, 8]], [2, 1, 3]
    meta = make_kda_metadata(decode_slots=[5, 0, 8], spec_slots=spec_slots, num_accepted_tokens=accepted,
                             prefill_lens=[4] if with_prefill else [], prefill_slots=[9] if with_prefill else [],
                             prefill_has_initial_state=[False] if with_prefill else [])
    assert meta.num_decode_tokens == 3 * (S + 1)
    x = torch.randn(meta.num_tokens, HID, dtype=torch.float64)
    calls = spy(layer)
    use(layer, meta)
    qkv, beta, forget_logits, output_gate_logits = layer.project(x)
    out = torch.full((meta.num_tokens, H, D), float("nan"), dtype=torch.float64)
    route = layer._forward(qkv, forget_logits, beta, output_gate_logits, out)
    assert route == ("mixed" if with_prefill else "speculative")
    seqs = calls[0][1][3]  # (inputs, weights, cache, seqs, out)
    assert calls[0][0] == "decode" and seqs.spec_state_indices is meta.spec_state_indices
    assert seqs.num_accepted_tokens is meta.num_accepted_tokens
    assert [c[0] for c in calls[1:]] == (["prefill"] if with_prefill else [])

    # The same numbers as the reference verify called directly on the same inputs and pools.
    nd = meta.num_decode_tokens
    ref_out = torch.full((nd, H, D), float("nan"), dtype=torch.float64)
    conv, rec = conv0.clone(), rec0.clone()
    kda_decode_reference(KDAInputs(qkv[:nd], forget_logits[:nd], beta[:nd], output_gate_logits[:nd]), layer.kda_weights,
                         KDACache(conv, rec),
                         DecodeSeqs(meta.decode_state_indices, meta.spec_state_indices, meta.num_accepted_tokens), ref_out)
    valid = torch.tensor([True] * 3 + [False] * 3 + [True] * 3)
    assert_rel_close(out[:nd][valid], ref_out[valid], 1e-12, "speculative verify through the layer")
    assert torch.isnan(out[:nd][~valid]).all(), "padding rows of a verify step were written"
    for s in (3, 4, 5, 6, 7, 8):
        assert_rel_close(layer.recurrent_state[s], rec[s], 1e-12, f"per-token state slot {s}")


def test_a_step_without_metadata_touches_no_state():
    layer = make_layer()
    calls = spy(layer)
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    x = torch.randn(5, HID, dtype=torch.float64)
    for meta in (None, KDAStepMetadata()):
        use(layer, meta)
        qkv, beta, forget_logits, output_gate_logits = layer.project(x)
        out = torch.full((5, H, D), float("nan"), dtype=torch.float64)
        assert layer._forward(qkv, forget_logits, beta, output_gate_logits, out) == "none"
        assert torch.equal(out, torch.zeros_like(out))
        y = run(layer, meta, x)
        assert torch.equal(y, torch.zeros_like(y))
    assert calls == []
    assert torch.equal(layer.conv_state, conv0) and torch.equal(layer.recurrent_state, rec0)


def test_routes_by_step_kind():
    build = make_layer(num_spec_tokens=1).backends.build_step
    assert step_route(None) == "none" and build(None) is None and build(KDAStepMetadata()) is None
    assert step_route(build(make_kda_metadata(decode_slots=[1, 2]))) == "decode"
    assert step_route(build(make_kda_metadata(prefill_lens=[3], prefill_slots=[1],
                                              prefill_has_initial_state=[False]))) == "prefill"
    assert step_route(build(make_kda_metadata(decode_slots=[1], spec_slots=[[1, 2]], num_accepted_tokens=[1]))) == "speculative"
    assert step_route(build(make_kda_metadata(decode_slots=[1], prefill_lens=[3], prefill_slots=[2],
                                              prefill_has_initial_state=[False]))) == "mixed"


def test_decode_padding_rows_touch_nothing():
    layer = make_layer()
    conv0, rec0 = layer.conv_state.clone(), layer.recurrent_state.clone()
    run(layer, make_kda_metadata(decode_slots=[0, 4, -1]), torch.randn(3, HID, dtype=torch.float64))
    assert_slots_untouched(rec0, layer.recurrent_state, [4], "recurrent pool")
    assert_slots_untouched(conv0, layer.conv_state, [4], "conv pool")
    assert not torch.equal(rec0[4], layer.recurrent_state[4])


def test_token_count_must_match_the_metadata():
    layer = make_layer()
    with pytest.raises(ValueError, match="3 tokens given, but the step counts 2 decode"):
        run(layer, make_kda_metadata(decode_slots=[1, 2]), torch.randn(3, HID, dtype=torch.float64))
    layer.conv_state = layer.recurrent_state = None
    with pytest.raises(ValueError, match="bind_cache"):
        run(layer, make_kda_metadata(decode_slots=[1, 2]), torch.randn(2, HID, dtype=torch.float64))


def test_a_step_is_run_only_by_the_pair_that_built_it():
    """A step's prefill tables fit the kernels and heads of the pair that built it: a layer with
    another pair refuses it by name, and incomplete metadata is refused when the step is built."""
    layer, other = make_layer(), KDALayer.build(HID, 2 * H, D, conv_kernel_size=W, **F64)
    x = torch.randn(2, HID, dtype=torch.float64)
    qkv, beta, forget_logits, output_gate_logits = layer.project(x)
    out = torch.empty(2, H, D, dtype=torch.float64)
    inputs = KDAInputs(qkv, forget_logits, beta, output_gate_logits)
    foreign = other.backends.build_step(make_kda_metadata(decode_slots=[1, 2]))
    with pytest.raises(ValueError, match=rf"built by the reference\+reference pair for {2 * H} heads, run by the layer's "
                                         rf"reference\+reference for {H}"):
        run_kda_step(foreign, inputs, layer.kda_weights, layer.cache, out, layer.backends)
    with pytest.raises(ValueError, match="decodes without decode_state_indices"):
        layer.backends.build_step(KDAStepMetadata(num_decodes=2, num_decode_tokens=2))
    with pytest.raises(ValueError, match="prefills without cu_seqlens"):
        layer.backends.build_step(KDAStepMetadata(num_prefills=1, num_prefill_tokens=2))
    with pytest.raises(ValueError, match="a CUDA graph captures decode steps only"):
        layer.backends.build_for_capture(make_kda_metadata(prefill_lens=[2], prefill_slots=[3],
                                                           prefill_has_initial_state=[False]))



def test_forward_follows_the_checkpoint_layout():
    """The layer's output from the checkpoint tensors by hand: q|k|v|b|f_a|g_a column order,
    f_b/g_b up-projections, the reference core, o_proj."""
    ckpt = random_kda_checkpoint(HID, H, D, conv_width=W, dtype=torch.float64, seed=2)
    layer = make_layer()
    conv, rec = layer.conv_state.clone(), layer.recurrent_state.clone()
    meta = make_kda_metadata(prefill_lens=[5, 3], prefill_slots=[1, 2], prefill_has_initial_state=[True, False])
    x = torch.randn(8, HID, dtype=torch.float64)
    y = run(layer, meta, x)

    P = H * D
    proj = x @ ckpt["in_proj_qkvbfg_a.weight"].T
    qkv, b, fa, ga = proj[:, : 3 * P], proj[:, 3 * P : 3 * P + H], proj[:, 3 * P + H : 3 * P + H + D], proj[:, 3 * P + H + D :]
    forget_logits, output_gate_logits = fa @ ckpt["f_b_proj.weight"].T, ga @ ckpt["g_b_proj.weight"].T
    w = layer.kda_weights
    assert torch.equal(w.conv_weight, torch.cat([ckpt[f"{c}_conv1d.weight"][:, 0] for c in "qkv"]).float())
    assert torch.equal(w.dt_bias, ckpt["dt_bias"].view(H, D).float())
    core = torch.empty(8, H, D, dtype=torch.float64)
    kda_prefill_reference(KDAInputs(qkv, forget_logits, b, output_gate_logits), w, KDACache(conv, rec),
                          PrefillSeqs(meta.prefill_cu_seqlens, meta.prefill_state_indices, meta.prefill_has_initial_state,
                                      meta.prefill_cu_seqlens_cpu), core)
    assert_rel_close(y, core.view(8, P) @ ckpt["o_proj.weight"].T, 1e-12, "layer output")
