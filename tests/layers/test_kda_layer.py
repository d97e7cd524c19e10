"""The KDA layer's weights: checkpoint names and shards, the merged conv buffer its three conv
weights are views of, derived copies refreshed after every write path at an unchanged address,
and a decode after a refit that really uses the new weights."""

import dataclasses

import pytest
import torch

from kdaserve.backends import BackendSpec, BackendUnavailableError, register_backend, unregister_backend
from kdaserve.layers.context import Context, reset_context, set_context
from kdaserve.layers.kda import KDALayer
from kdaserve.layers.kda_routing import make_kda_metadata
from kdaserve.layers.kda_weights import CHECKPOINT_NAMES, random_kda_checkpoint
from kdaserve.ops.kda.reference import kda_decode_reference
from kdaserve.testing import assert_rel_close

HID, H, D, W = 48, 4, 16, 4
F64 = dict(params_dtype=torch.float64, state_dtype=torch.float64)


def toy_layout(conv_weight, out=None):
    """A [3, W, P] derived layout, like the fused decode's."""
    d = conv_weight.view(3, -1, conv_weight.shape[1]).permute(0, 2, 1)
    if out is None:
        return d.contiguous()
    out.copy_(d)
    return out


def toy_decode(inputs, weights, cache, seqs, out):
    """The reference decode, but reading the conv weight ONLY from the derived copy: a stale copy
    gives a wrong result."""
    derived = weights.conv_weight_decode
    merged = derived.permute(0, 2, 1).reshape(-1, derived.shape[1])
    kda_decode_reference(inputs, dataclasses.replace(weights, conv_weight=merged.to(weights.conv_weight.dtype)), cache,
                         seqs, out)


@pytest.fixture
def toy_backend():
    register_backend(BackendSpec("toy_derived", "decode", "test", lambda: toy_decode, lambda: (),
                                 conv_weight_decode_layout=lambda: toy_layout))
    yield "toy_derived"
    unregister_backend("decode", "toy_derived")


@pytest.fixture(autouse=True)
def _clean_context():
    yield
    reset_context()


def make_layer(decode_backend="reference", seed=0, **kw):
    layer = KDALayer.build(HID, H, D, conv_kernel_size=W, decode_backend=decode_backend, **{**F64, **kw})
    layer.load_weights(random_kda_checkpoint(HID, H, D, conv_width=W, dtype=torch.float64, seed=seed).items())
    return layer


def bind_random_cache(layer, num_slots=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    spec = layer.cache_spec()
    conv = torch.randn(num_slots, *spec["conv"][0], generator=g).to(spec["conv"][1])
    rec = (0.2 * torch.randn(num_slots, *spec["recurrent"][0], generator=g)).to(spec["recurrent"][1])
    layer.bind_cache(conv, rec)
    return conv, rec


def test_parameters_are_named_like_the_checkpoint():
    layer = make_layer()
    assert set(layer.state_dict()) == set(CHECKPOINT_NAMES)
    for name in CHECKPOINT_NAMES:
        assert callable(layer.get_parameter(name).weight_loader)
    assert layer.A_log.dtype == layer.dt_bias.dtype == layer.conv_weight.dtype == torch.float32


def test_conv_weights_are_views_of_the_merged_buffer():
    layer = make_layer()
    P = H * D
    for i, holder in enumerate((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
        assert holder.weight.shape == (P, 1, W)
        assert holder.weight.data_ptr() == layer.conv_weight[i * P].data_ptr()
    with torch.no_grad():
        layer.v_conv1d.weight[3, 0, 2] = 123.0  # a write through a view lands in the merged buffer
    assert layer.conv_weight[2 * P + 3, 2] == 123.0
    ckpt = random_kda_checkpoint(HID, H, D, conv_width=W, seed=5)
    addr = layer.conv_weight.data_ptr()
    layer.load_weights(ckpt.items())
    assert layer.conv_weight.data_ptr() == addr
    assert torch.equal(layer.conv_weight, torch.cat([ckpt[n][:, 0] for n in ("q_conv1d.weight", "k_conv1d.weight",
                                                                             "v_conv1d.weight")]))


def test_derived_copy_follows_load_reload_refit_and_weight_loader_at_one_address(toy_backend):
    layer = make_layer(decode_backend=toy_backend)
    derived = layer.conv_weight_decode
    addr = derived.data_ptr()

    def in_sync():
        return derived.data_ptr() == addr and torch.equal(derived, toy_layout(layer.conv_weight))

    assert in_sync()  # initial load
    layer.load_weights(random_kda_checkpoint(HID, H, D, conv_width=W, seed=7).items())  # reload
    assert in_sync()
    new_k = torch.randn(H * D, 1, W, dtype=torch.float64)
    layer.load_weights([("k_conv1d.weight", new_k)])  # in-place refit of one tensor
    assert in_sync() and torch.equal(layer.k_conv1d.weight, new_k.float())
    p = layer.q_conv1d.weight
    p.weight_loader(p, torch.randn(H * D, W))  # a loader that calls weight_loader directly (2-D accepted)
    assert in_sync()
    assert layer.conv_weight_decode is derived and layer.kda_weights.conv_weight_decode is derived


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_refreshes_the_merged_buffer_and_derived_copy(toy_backend, assign):
    """load_state_dict is torch's own reload path: it writes q/k/v_conv1d.weight (or, with assign,
    replaces them), never through a weight_loader. The merged buffer must still hold the new taps,
    the three weights stay views of it, and the derived copy follows, at unchanged addresses."""
    layer = make_layer(decode_backend=toy_backend)
    merged_addr, derived_addr = layer.conv_weight.data_ptr(), layer.conv_weight_decode.data_ptr()
    other = make_layer(seed=9)
    layer.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=assign)
    P = H * D
    assert layer.conv_weight.data_ptr() == merged_addr and torch.equal(layer.conv_weight, other.conv_weight)
    for i, holder in enumerate((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
        assert holder.weight.data_ptr() == layer.conv_weight[i * P].data_ptr()
    assert layer.conv_weight_decode.data_ptr() == derived_addr
    assert torch.equal(layer.conv_weight_decode, toy_layout(layer.conv_weight))
    layer.load_weights(random_kda_checkpoint(HID, H, D, conv_width=W, seed=12).items())  # loaders still attached
    assert torch.equal(layer.conv_weight_decode, toy_layout(layer.conv_weight))


def test_decode_after_a_refit_uses_the_new_weights(toy_backend):
    layer = make_layer(decode_backend=toy_backend)  # reads the conv weight only from the derived copy
    conv, rec = bind_random_cache(layer)
    conv0, rec0 = conv.clone(), rec.clone()
    refit = random_kda_checkpoint(HID, H, D, conv_width=W, dtype=torch.float64, seed=11)
    conv_only = [(k, v) for k, v in refit.items() if k.endswith("conv1d.weight")]
    layer.load_weights(conv_only)
    x = torch.randn(2, HID, dtype=torch.float64)
    meta = make_kda_metadata(decode_slots=[2, 4])
    set_context(Context(kda=layer.backends.build_step(meta)))
    y = layer(x)

    def reference_run(weights):
        ref = make_layer()  # reference decode: reads conv_weight directly
        ref.load_weights(weights)
        ref.bind_cache(conv0.clone(), rec0.clone())
        set_context(Context(kda=ref.backends.build_step(meta)))
        return ref(x), ref.recurrent_state

    y_new, rec_new = reference_run(conv_only)
    y_old, _ = reference_run([])
    assert_rel_close(y, y_new, 1e-12, "decode after refit")
    assert_rel_close(rec, rec_new, 1e-12, "state after refit")
    assert (y_new - y_old).abs().max() > 1e-3  # the refit changes the result: the check has teeth


def test_tensor_parallel_shards_sum_to_the_full_layer():
    """Heads are independent: rank outputs (partial o_proj sums) add up to the tp=1 layer's."""
    ckpt = random_kda_checkpoint(HID, H, D, conv_width=W, dtype=torch.float64, seed=3)
    x = torch.randn(7, HID, dtype=torch.float64)
    meta = make_kda_metadata(decode_slots=[1], prefill_lens=[4, 2], prefill_slots=[2, 3], prefill_has_initial_state=[True, False])
    full = KDALayer.build(HID, H, D, **F64)
    full.load_weights(ckpt.items())
    conv, rec = bind_random_cache(full)
    conv0, rec0 = conv.clone(), rec.clone()
    set_context(Context(kda=full.backends.build_step(meta)))
    y_full = full(x)
    P2 = H * D // 2
    y_sum = torch.zeros_like(y_full)
    for rank in range(2):
        part = KDALayer.build(HID, H, D, tp_rank=rank, tp_size=2, **F64)
        assert part.load_weights(ckpt.items()) == set(CHECKPOINT_NAMES)
        assert part.num_heads == H // 2 and torch.equal(part.A_log, ckpt["A_log"][rank * 2 : rank * 2 + 2].float())
        # f_a and g_a are replicated: the last 2D rows of the fused projection equal the full layer's.
        assert torch.equal(part.in_proj_qkvbfg_a.weight[-2 * D :], full.in_proj_qkvbfg_a.weight[-2 * D :])
        heads = slice(rank * 2, rank * 2 + 2)
        cs = conv0.view(conv0.shape[0], W - 1, 3, H, D)[:, :, :, heads].reshape(conv0.shape[0], W - 1, 3 * P2)
        part.bind_cache(cs.contiguous(), rec0[:, heads].clone())
        set_context(Context(kda=part.backends.build_step(meta)))   # each rank's pair: its own heads
        y_sum += part(x)
        assert_rel_close(part.recurrent_state, rec[:, heads], 1e-12, f"rank {rank} states")
    assert_rel_close(y_sum, y_full, 1e-12, "sum of tensor-parallel ranks")


def _released_parts(ckpt: dict, full_rank: bool) -> list[tuple[str, torch.Tensor]]:
    """A layer checkpoint as released: the merged projection split into its named parts; with
    `full_rank`, Ling-3's f_proj, g_proj [P, hidden] = f_b·f_a, g_b·g_a of the same low-rank layer."""
    P = H * D
    q, k, v, b, fa, ga = ckpt["in_proj_qkvbfg_a.weight"].split([P, P, P, H, D, D])
    parts = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "b_proj.weight": b}
    rest = {n: t for n, t in ckpt.items() if n not in ("in_proj_qkvbfg_a.weight", "f_b_proj.weight", "g_b_proj.weight")}
    if full_rank:
        parts.update({"f_proj.weight": ckpt["f_b_proj.weight"] @ fa, "g_proj.weight": ckpt["g_b_proj.weight"] @ ga})
    else:
        parts.update({"f_a_proj.weight": fa, "g_a_proj.weight": ga, "f_b_proj.weight": ckpt["f_b_proj.weight"],
                      "g_b_proj.weight": ckpt["g_b_proj.weight"]})
    return [*parts.items(), *rest.items()]


def test_full_rank_gates_equal_the_low_rank_layer_they_multiply_out_and_split_over_ranks():
    """Ling-3's gates (f_proj, g_proj [P, hidden]; no f_b, g_b): a layer loaded with f = f_b·f_a and
    g = g_b·g_a from its released parts gives the low-rank layer's output and states (mixed
    decode + prefill step), and its two tensor-parallel halves, each loading only its heads' rows
    of f_proj and g_proj, sum to it."""
    ckpt = random_kda_checkpoint(HID, H, D, conv_width=W, dtype=torch.float64, seed=5)
    x = torch.randn(7, HID, dtype=torch.float64)
    meta = make_kda_metadata(decode_slots=[1], prefill_lens=[4, 2], prefill_slots=[2, 3], prefill_has_initial_state=[True, False])
    low = KDALayer.build(HID, H, D, **F64)
    low.load_weights(_released_parts(ckpt, full_rank=False))
    conv0, rec0 = (t.clone() for t in bind_random_cache(low))
    set_context(Context(kda=low.backends.build_step(meta)))
    y_low = low(x)
    full = KDALayer.build(HID, H, D, full_rank_gates=True, **F64)
    assert set(full.state_dict()) == set(CHECKPOINT_NAMES) - {"f_b_proj.weight", "g_b_proj.weight"}
    assert full.in_proj_qkvbfg_a.weight.shape == (5 * H * D + H, HID)
    full.load_weights(_released_parts(ckpt, full_rank=True))
    full.bind_cache(conv0.clone(), rec0.clone())
    set_context(Context(kda=full.backends.build_step(meta)))
    y_full = full(x)
    assert_rel_close(y_full, y_low, 1e-12, "full-rank gates vs the low-rank layer")
    assert_rel_close(full.recurrent_state, low.recurrent_state, 1e-12, "states")
    P2, y_sum = H * D // 2, torch.zeros_like(y_full)
    for rank in range(2):
        part = KDALayer.build(HID, H, D, tp_rank=rank, tp_size=2, full_rank_gates=True, **F64)
        part.load_weights(_released_parts(ckpt, full_rank=True))
        heads = slice(rank * 2, rank * 2 + 2)
        cs = conv0.view(conv0.shape[0], W - 1, 3, H, D)[:, :, :, heads].reshape(conv0.shape[0], W - 1, 3 * P2)
        part.bind_cache(cs.contiguous(), rec0[:, heads].clone())
        set_context(Context(kda=part.backends.build_step(meta)))
        y_sum += part(x)
    assert_rel_close(y_sum, y_full, 1e-12, "sum of tensor-parallel ranks, full-rank gates")
    with pytest.raises(KeyError, match="valid names"):
        full.load_weights([("f_b_proj.weight", ckpt["f_b_proj.weight"])])


@pytest.mark.parametrize("shape", [(H,), (1, 1, H, 1)])
def test_A_log_accepts_1d_and_kimi_shapes(shape):
    layer = make_layer()
    a = torch.randn(shape)
    layer.load_weights([("A_log", a)])
    assert torch.equal(layer.A_log, a.reshape(H))


def test_bad_checkpoint_tensors_are_explained():
    layer = make_layer()
    with pytest.raises(KeyError, match="valid names"):
        layer.load_weights([("in_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"in_proj_qkvbfg_a.weight must be \[3P\+H\+2D, hidden\]"):
        layer.load_weights([("in_proj_qkvbfg_a.weight", torch.zeros(10, HID))])
    with pytest.raises(ValueError, match="A_log must hold 4 values"):
        layer.load_weights([("A_log", torch.zeros(5))])
    with pytest.raises(ValueError, match="cannot be split evenly"):
        KDALayer.build(HID, 3, D, tp_size=2, **F64)


@pytest.mark.parametrize("layout, spec_tokens", [("SD", 0), ("DS", 2)])
def test_cache_spec_and_bind_cache(layout, spec_tokens):
    layer = make_layer(conv_layout=layout, num_spec_tokens=spec_tokens)
    spec = layer.cache_spec()
    rows = W - 1 + spec_tokens
    assert spec["conv"] == (((rows, 3 * H * D) if layout == "SD" else (3 * H * D, rows)), torch.float64)
    assert spec["recurrent"] == ((H, D, D), torch.float64)
    bind_random_cache(layer)
    with pytest.raises(ValueError, match="conv pool must be"):
        layer.bind_cache(torch.zeros(5, 3 * H * D, W - 1 + spec_tokens + 1, dtype=torch.float64), layer.recurrent_state)
    with pytest.raises(ValueError, match="recurrent pool must be"):
        layer.bind_cache(layer.conv_state, layer.recurrent_state.float())


def test_impossible_backends_fail_at_construction():
    with pytest.raises(BackendUnavailableError, match="unmet requirement"):
        KDALayer.build(HID, H, D, decode_backend="aiter", device="cpu")
    with pytest.raises(BackendUnavailableError, match="unmet requirement"):
        KDALayer.build(HID, H, D, prefill_backend="flashkda", device="cpu")
    with pytest.raises(ValueError, match="lower_bound"):
        KDALayer.build(HID, H, D, lower_bound=-7.0)


def test_device_moves_keep_the_views_and_derived_copies(toy_backend):
    layer = make_layer(decode_backend=toy_backend)
    layer.double()  # converts every tensor: the views must re-alias the moved merged buffer
    P = H * D
    assert layer.conv_weight.dtype == torch.float64
    for i, holder in enumerate((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
        assert holder.weight.data_ptr() == layer.conv_weight[i * P].data_ptr()
    assert torch.equal(layer.conv_weight_decode, toy_layout(layer.conv_weight))


@pytest.mark.parametrize("assign", [False, True])
def test_gate_b_projections_are_views_of_one_buffer_through_loads_and_moves(assign):
    """f_b_proj.weight and g_b_proj.weight live in gate_b_weight [2, P, D], which project()'s one
    batched GEMM reads: a load by name, torch's load_state_dict (assign or not) and a dtype move
    all leave them views of it holding the loaded values, and the gates equal two plain GEMMs."""
    layer = make_layer()
    addr = layer.gate_b_weight.data_ptr()

    def views_hold(f, g):
        return (layer.f_b_proj.weight.data_ptr() == layer.gate_b_weight[0].data_ptr()
                and layer.g_b_proj.weight.data_ptr() == layer.gate_b_weight[1].data_ptr()
                and torch.equal(layer.gate_b_weight[0], f) and torch.equal(layer.gate_b_weight[1], g))

    ckpt = random_kda_checkpoint(HID, H, D, conv_width=W, dtype=torch.float64, seed=4)
    layer.load_weights([("f_b_proj.weight", ckpt["f_b_proj.weight"]), ("g_b_proj.weight", ckpt["g_b_proj.weight"])])
    assert views_hold(ckpt["f_b_proj.weight"], ckpt["g_b_proj.weight"]) and layer.gate_b_weight.data_ptr() == addr
    other = make_layer(seed=9)
    layer.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=assign)
    assert views_hold(other.f_b_proj.weight, other.g_b_proj.weight) and layer.gate_b_weight.data_ptr() == addr
    x = torch.randn(5, HID, dtype=torch.float64)
    _, _, forget, out_gate = layer.project(x)
    proj = layer.in_proj_qkvbfg_a(x)
    f_a, g_a = proj[:, 3 * H * D + H : 3 * H * D + H + D], proj[:, 3 * H * D + H + D :]
    torch.testing.assert_close(forget, f_a @ other.f_b_proj.weight.T)
    torch.testing.assert_close(out_gate, g_a @ other.g_b_proj.weight.T)
    layer.float()   # a dtype move converts the buffer and the parameters apart: the views re-alias
    assert views_hold(other.f_b_proj.weight.float(), other.g_b_proj.weight.float())
