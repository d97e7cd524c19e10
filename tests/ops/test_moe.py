"""Mixture-of-experts kernels (kdaserve/ops/moe) against the torch reference: the router's rules,
the alignment of slots by expert, and the fused grouped GEMMs, including empty experts, one token
per expert and every token to one expert. CPU: the interpreter in fp32; GPU: bf16 at Kimi-Linear's
sizes (256 experts, top 8, hidden 2304, width 1024)."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.ops.moe import RouterConfig, moe_experts_reference, route_tokens
from kdaserve.ops.moe.align import PER_EXPERT_MAX_SLOTS, align_to_experts, max_sorted_entries
from kdaserve.testing.compare import assert_rel_close

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


def experts(E, hidden, inter, *, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def test_router_rules():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 16, generator=g), torch.randn(8, 16, generator=g)
    bias = torch.zeros(8)
    bias[3] = 10.0                                   # the bias chooses expert 3 for every token...
    weights, ids = route_tokens(x, w, bias, RouterConfig(8, 2, routed_scaling_factor=3.0))
    assert (ids == 3).any(-1).all()
    scores = torch.sigmoid(x @ w.T)                  # ...but the weight is the unbiased score, renormalised
    want = scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True) * 3.0
    torch.testing.assert_close(weights, want)
    _, ids = route_tokens(x, w, None, RouterConfig(8, 2, num_groups=4, topk_groups=1))
    assert ((ids // 2)[:, 0] == (ids // 2)[:, 1]).all()   # one group of 2 allowed: both from it
    with pytest.raises(ValueError, match="cannot be chosen from 1 groups of 2"):
        RouterConfig(8, 3, num_groups=4, topk_groups=1)



@INTERP
@pytest.mark.parametrize("T, E, k, scoring, with_bias, renormalize", [
    (37, 256, 8, "sigmoid", True, True),     # Kimi-Linear's router: 256 experts, top 8, correction bias
    (5, 12, 3, "softmax", False, True),      # softmax scores, experts not a power of two
    (1, 64, 6, "sigmoid", True, False),      # one token, no renormalization
    (20, 8, 1, "softmax", True, True),       # top 1
    (301, 16, 2, "sigmoid", True, True),     # several rows per program, the last one short
], ids=["kimi", "softmax-odd", "one-token-raw", "top-1", "rows-per-program"])
def test_routing_kernel_equals_the_torch_path(T, E, k, scoring, with_bias, renormalize):
    """Same experts in the same (descending) order, same weights; the bias chooses, never weights."""
    g = torch.Generator().manual_seed(T * 7 + E)
    x, w = torch.randn(T, 32, generator=g), torch.randn(E, 32, generator=g) * 0.3
    bias = torch.randn(E, generator=g) * 0.5 if with_bias else None
    cfg = RouterConfig(E, k, scoring, renormalize=renormalize, routed_scaling_factor=2.446)
    want_w, want_ids = route_tokens(x, w, bias, cfg, use_kernel=False)
    got_w, got_ids = route_tokens(x, w, bias, cfg, use_kernel=True)
    assert torch.equal(got_ids, want_ids) and got_ids.dtype == torch.int64
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@INTERP
def test_routing_appends_the_extra_expert():
    """extra_expert: every token's last column is that expert with weight 1 (kernel and torch path
    alike), the k routed columns as without it."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(9, 32, generator=g), torch.randn(16, 32, generator=g) * 0.3
    cfg = RouterConfig(16, 3, routed_scaling_factor=2.5)
    plain_w, plain_ids = route_tokens(x, w, None, cfg, use_kernel=False)
    for use_kernel in (True, False):
        got_w, got_ids = route_tokens(x, w, None, cfg, use_kernel=use_kernel, extra_expert=16)
        assert got_ids.shape == (9, 4) and torch.equal(got_ids[:, :3], plain_ids) and (got_ids[:, 3] == 16).all()
        torch.testing.assert_close(got_w[:, :3], plain_w, rtol=1e-6, atol=1e-7)
        assert (got_w[:, 3] == 1.0).all()


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("T, E, k, groups, open_groups, extra", [
    (9, 512, 8, 8, 4, None),      # Ling-3.0-Flash: 512 experts in 8 groups, 4 open, top 8
    (5, 12, 3, 4, 2, None),       # groups of 3 (not a power of two)
    (9, 8, 2, 8, 3, None),        # groups of one expert: a group's score is its expert's
    (301, 16, 3, 4, 2, 16),       # several rows per program, the shared expert appended
], ids=["ling", "groups-of-3", "groups-of-1", "rows-per-program-extra"])
def test_routing_kernel_restricts_to_groups_like_the_torch_path(T, E, k, groups, open_groups, extra):
    """Group-limited routing (a group's score: the sum of its two best choice scores) in the kernel
    equals the torch path (the definition, checked against transformers in tests/models), and the
    restriction changes the choice (against the same routing without groups). On the GPU when there
    is one, else in the interpreter."""
    g = torch.Generator().manual_seed(T + E)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = torch.randn(T, 32, generator=g).to(dev), (torch.randn(E, 32, generator=g) * 0.3).to(dev)
    bias = (torch.randn(E, generator=g) * 0.05).to(dev)
    cfg = RouterConfig(E, k, "sigmoid", groups, open_groups, True, 2.5)
    want_w, want_ids = route_tokens(x, w, bias, cfg, use_kernel=False, extra_expert=extra)
    got_w, got_ids = route_tokens(x, w, bias, cfg, use_kernel=True, extra_expert=extra)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    group_of = want_ids[:, :k] // (E // groups)
    assert all(len(set(row.tolist())) <= open_groups for row in group_of)
    if E // groups > 1:   # groups of one: the best experts' groups are the best groups, no restriction
        _, free_ids = route_tokens(x, w, bias, RouterConfig(E, k, "sigmoid", 1, 1, True, 2.5), use_kernel=False)
        assert not torch.equal(free_ids, want_ids[:, :k])

@pytest.mark.parametrize("block_m", [4, 16])
def test_alignment_groups_slots_by_expert_in_padded_blocks(block_m):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (13, 3), generator=g)
    ids[:, 0] = 5                                     # a crowded expert; expert 0..4 some empty
    sorted_slots, block_experts = align_to_experts(ids, 6, block_m)
    S = ids.numel()
    assert sorted_slots.numel() == max_sorted_entries(S, 6, block_m) == block_experts.numel() * block_m
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(block_experts.tolist()):
        block = sorted_slots[b * block_m : (b + 1) * block_m].tolist()
        real = [s for s in block if s < S]
        if e < 0:
            assert not real
        assert all(flat[s] == e for s in real)
        seen += real
    assert sorted(seen) == list(range(S))            # every slot exactly once


@INTERP
@pytest.mark.parametrize("path", ["per_expert", "blocks"])
@pytest.mark.parametrize("T, k, E, block_m", [(13, 3, 6, 4), (1, 8, 256, 16), (64, 8, 256, 16), (5, 2, 7, 32),
                                              (300, 8, 256, 64), (3, 1, 1, 16), (512, 8, 256, 16), (133, 8, 24, 32)],
                         ids=["small", "decode-1", "decode-64", "odd-experts", "prefill-300", "one-expert", "4096-slots",
                              "1064-slots"])
def test_triton_alignments_equal_the_torch_path(T, k, E, block_m, path):
    """The Triton alignments (per expert: steps up to PER_EXPERT_MAX_SLOTS on a GPU; blocks of
    slots: larger ones) give the torch path's tables exactly: slots of one expert in slot order,
    padding S, -1 past the end; output buffers start as junk (the blocks path: slots split over
    several programs, a program's share not a multiple of its step; per expert: one program per
    expert, each from the whole step's histogram)."""
    if path == "per_expert" and T * k > PER_EXPERT_MAX_SLOTS:
        with pytest.raises(ValueError, match="at most"):
            align_to_experts(torch.zeros(T, k, dtype=torch.int64), E, block_m, path=path)
        return
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.randint(0, E, (T, k), generator=g)
    if T > 4:
        ids[: T // 2, 0] = E - 1                      # one crowded expert, others empty
    want = align_to_experts(ids, E, block_m, path="torch")
    got = align_to_experts(ids, E, block_m, path=path)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@INTERP
@pytest.mark.parametrize("path", ["per_expert", "blocks"])
@pytest.mark.parametrize("T, k, E, block_m", [(1, 8, 256, 16), (64, 8, 256, 16), (13, 3, 6, 4), (20, 2, 7, 32)],
                         ids=["decode-1", "decode-64", "small", "odd-experts"])
def test_an_extra_expert_column_aligns_like_one_more_expert(T, k, E, block_m, path):
    """extra_expert (the shared expert as expert E, every token's last column): the same tables as
    the torch path over E + 1 experts, its run after the routed ones (at 256 routed experts the
    per-expert kernel's histogram is 512 bins wide: E + 1 bins and its tail program)."""
    g = torch.Generator().manual_seed(T * 7 + E)
    ids = torch.cat([torch.randint(0, E, (T, k), generator=g), torch.full((T, 1), E)], 1)
    want = align_to_experts(ids, E + 1, block_m, path="torch")
    got = align_to_experts(ids, E, block_m, path=path, extra_expert=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[1] == E).sum() == -(-T // block_m)   # the extra expert's blocks


@INTERP
@pytest.mark.parametrize("per_program", [16, 24, 100])
def test_blocks_alignment_over_many_programs_equals_the_torch_path(per_program, monkeypatch):
    """Prefill's alignment with more programs than its offsets step takes in one tile (several
    tiles, a ragged last one), shares that are not multiples of the program's step."""
    from kdaserve.ops.moe import align

    monkeypatch.setattr(align, "SLOTS_PER_PROGRAM", per_program)
    g = torch.Generator().manual_seed(per_program)
    ids = torch.randint(0, 24, (133, 8), generator=g)
    ids[:40, 1] = 3
    want = align_to_experts(ids, 24, 32, path="torch")
    got = align_to_experts(ids, 24, 32, path="blocks")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_alignment_paths_are_named():
    with pytest.raises(ValueError, match="expected one of"):
        align_to_experts(torch.zeros(2, 1, dtype=torch.int64), 4, 16, path="sorted")


def test_per_expert_alignment_compiles_every_slot_tile_ahead(monkeypatch):
    """A compile-ahead pass (engine warm-up) launches the per-expert kernel at every slot tile up to
    PER_EXPERT_MAX_SLOTS, so no later step size compiles while serving; otherwise only the step's
    own tile (the next power of two of its slots, at least 16)."""
    from kdaserve.ops.moe import align

    tiles = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, S_P, **kw: tiles.append(S_P)

    monkeypatch.setattr(align, "_align_per_expert_kernel", Recorder())
    ids = torch.zeros(40, 9, dtype=torch.int64)
    align._align_per_expert(ids, 257, 16)
    assert tiles == [512]
    tiles.clear()
    monkeypatch.setattr(align, "compiling_ahead", lambda: True)
    align._align_per_expert(ids, 257, 16)
    assert tiles == [16 << i for i in range(9)] and tiles[-1] == PER_EXPERT_MAX_SLOTS


def _routing(T, E, k, mode, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mode == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    elif mode == "one-expert":                        # every token's first choice is expert 0
        ids = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(E - 1, generator=g)[: k - 1] + 1]) for _ in range(T)])
    else:                                             # "one-token-per-expert": T*k == E distinct experts
        ids = torch.randperm(E, generator=g)[: T * k].view(T, k)
    weights = torch.rand(T, k, generator=g) + 0.1
    return weights, ids


@INTERP
@pytest.mark.parametrize("mode, T, E, k", [("random", 13, 8, 3), ("one-expert", 20, 6, 2),
                                          ("one-token-per-expert", 4, 12, 3), ("random", 1, 16, 4)])
def test_fused_matches_the_reference_in_the_interpreter(mode, T, E, k):
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = experts(E, 32, 48)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(T, E, k, mode)
    assert_rel_close(moe_experts_fused(x, w13, w2, weights, ids), moe_experts_reference(x, w13, w2, weights, ids),
                     1e-5, f"fused MoE ({mode})")


@INTERP
@pytest.mark.parametrize("tiles", [
    (16, (16, 16, 4, 2), (16, 32, 4, 3)),    # K stepped by 16 and 32: no K mask (EVEN_K)
    (32, (32, 16, 4, 1), (16, 16, 4, 1)),    # 32 rows per program (mostly padding here), narrow tiles
    (16, (16, 32, 4, 2), (16, 64, 4, 2)),    # K steps wider than hidden (48) and I (32): masked
], ids=["even-k", "wide-rows", "masked-k"])
def test_fused_matches_the_reference_at_every_launch_shape(tiles):
    from kdaserve.ops.moe.fused import MoeTiles, moe_experts_fused

    w13, w2 = experts(6, 48, 32)
    x = torch.randn(11, 48, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(11, 6, 3, "random")
    got = moe_experts_fused(x, w13, w2, weights, ids, tiles=MoeTiles(*tiles))
    assert_rel_close(got, moe_experts_reference(x, w13, w2, weights, ids), 1e-5, f"fused MoE at {tiles}")


@INTERP
def test_fused_clamped_swiglu_matches_the_reference():
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = experts(4, 16, 16)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3)) * 4
    weights, ids = _routing(9, 4, 2, "random")
    want = moe_experts_reference(x, w13, w2, weights, ids, activation_limit=0.5)
    assert_rel_close(moe_experts_fused(x, w13, w2, weights, ids, activation_limit=0.5), want, 1e-5, "clamped")
    assert not torch.allclose(want, moe_experts_reference(x, w13, w2, weights, ids), atol=1e-3)   # the clamp bites


@INTERP
@pytest.mark.parametrize("T", [13, 0], ids=["tokens", "empty-step"])
def test_fused_adds_the_shared_experts_output_in_its_sum(T):
    """`addend` (the shared experts' output) joins the sum over the k choices: the reference's
    routed output plus it. Where the addend had been dropped (or added twice) the rows would be
    off by its size, which is as large as the routed part here."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = experts(8, 32, 48)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(8))
    weights, ids = _routing(T, 8, 3, "random") if T else (torch.ones(0, 3), torch.zeros(0, 3, dtype=torch.long))
    shared = torch.randn(T, 32, generator=torch.Generator().manual_seed(9))
    got = moe_experts_fused(x, w13, w2, weights, ids, addend=shared)
    want = moe_experts_reference(x, w13, w2, weights, ids) + shared
    assert got.shape == (T, 32)
    if T:
        assert_rel_close(got, want, 1e-5, "fused MoE + shared experts")
        strided = torch.randn(T, 64, generator=torch.Generator().manual_seed(10))[:, 16:48]   # a column slice
        assert_rel_close(moe_experts_fused(x, w13, w2, weights, ids, addend=strided),
                         moe_experts_reference(x, w13, w2, weights, ids) + strided, 1e-5, "strided addend")
    with pytest.raises(ValueError, match=r"addend must be \[T, hidden\]"):
        moe_experts_fused(x, w13, w2, weights, ids, addend=torch.zeros(T + 1, 32))


@INTERP
@pytest.mark.parametrize("T", [1, 13])
def test_fused_runs_a_shared_expert_as_one_more_expert(T):
    """`shared`: the shared expert's GEMMs inside the routed experts' launches, as expert E with
    weight 1 (the router's extra column): the reference's routed output plus the shared MLP's."""
    from kdaserve.ops.activation.swiglu import swiglu_reference
    from kdaserve.ops.moe.fused import moe_experts_fused

    E, k, hidden, inter = 8, 3, 32, 48
    w13, w2 = experts(E + 1, hidden, inter, seed=4)
    routed13, routed2, s13, s2 = w13[:E].clone(), w2[:E].clone(), w13[E].clone(), w2[E].clone()   # apart, as a layer holds them
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(13))
    weights, ids = _routing(T, E, k, "random")
    ext_w = torch.cat([weights, torch.ones(T, 1)], 1)
    ext_ids = torch.cat([ids, torch.full((T, 1), E)], 1)
    got = moe_experts_fused(x, routed13, routed2, ext_w, ext_ids, shared=(s13, s2))
    want = moe_experts_reference(x, routed13, routed2, weights, ids) + swiglu_reference(x @ s13.T) @ s2.T
    assert_rel_close(got, want, 1e-5, "MoE with the shared expert as expert E")
    with pytest.raises(ValueError, match="shared expert run with the routed ones needs their width"):
        moe_experts_fused(x, routed13, routed2, ext_w, ext_ids, shared=(s13[:, :16], s2))


@INTERP
@pytest.mark.parametrize("T", [10, 70], ids=["decode: shared as an expert", "prefill: shared in the sum"])
def test_layer_with_shared_experts_equals_its_reference(T, monkeypatch):
    """MoEMLP on the Triton backend against the same layer on the reference backend: at decode
    sizes the shared expert runs inside the fused kernels (as expert E), past them its SwiGLU
    kernel's output joins the routed experts' sum."""
    import kdaserve.ops.moe.fused as fused
    from kdaserve.layers.moe import SHARED_AS_EXPERT_MAX_TOKENS, MoEMLP

    router = RouterConfig(8, 2, routed_scaling_factor=2.5)
    layers = [MoEMLP(32, router, 24, num_shared_experts=1, backend=b, dtype=torch.float32) for b in ("triton", "reference")]
    g = torch.Generator().manual_seed(11)
    for p in layers[0].parameters():
        p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    assert layers[0].shared_experts.backend == "triton" and layers[1].shared_experts.backend == "reference"
    calls = []
    run = fused.moe_experts_fused
    monkeypatch.setattr(fused, "moe_experts_fused", lambda *a, **kw: calls.append(kw) or run(*a, **kw))
    x = torch.randn(T, 32, generator=g)
    assert_rel_close(layers[0](x), layers[1](x), 1e-5, "MoE layer with shared experts")
    as_expert = T <= SHARED_AS_EXPERT_MAX_TOKENS
    assert [("shared" in kw, "addend" in kw) for kw in calls] == [(as_expert, not as_expert)]


@INTERP
@pytest.mark.parametrize("T", [1, 13])
def test_skipped_choices_add_nothing(T):
    """Expert parallelism: choices of another rank's experts come as id E with weight 0; the fused
    path aligns them as one more expert that no program runs, and their rows add nothing: the
    same as the reference over this rank's choices alone."""
    from kdaserve.ops.moe.fused import moe_experts_fused

    E, k = 4, 3
    w13, w2 = experts(E, 32, 48)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(T))
    weights, ids = _routing(T, 2 * E, k, "random", seed=T)   # 8 experts over two ranks: this one holds 0..3
    mine = ids < E
    local_ids, local_w = torch.where(mine, ids, E), torch.where(mine, weights, 0.0)
    want = moe_experts_reference(x, w13, w2, local_w, torch.where(mine, ids, 0))   # weight 0: nothing added
    got_ref = moe_experts_reference(x, w13, w2, local_w, local_ids, skip_expert=True)
    assert torch.equal(got_ref, want)
    assert_rel_close(moe_experts_fused(x, w13, w2, local_w, local_ids, skip_expert=True), want, 1e-5, "skipped choices")


def test_fused_refuses_mismatched_weights():
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = experts(4, 16, 16)
    with pytest.raises(ValueError, match=r"w2 \[E, hidden, I\]"):
        moe_experts_fused(torch.randn(3, 16), w13, w2[:, :, :8], torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"a hidden size and an expert width of at least 1, got 16 and 0"):
        moe_experts_fused(torch.randn(3, 16), w13[:, :0], w2[:, :, :0], torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long))


def _kimi_linear_step(T: int, seed: int):
    """Kimi-Linear's experts (256 of width 1024 on hidden 2304, top 8) in bf16 on the GPU, T tokens
    and the router's own choices for them: (x, w13, w2, weights, ids)."""
    E, k, hidden, inter = 256, 8, 2304, 1024
    w13, w2 = experts(E, hidden, inter, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, hidden, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, hidden, device="cuda", generator=g) * hidden**-0.5
    weights, ids = route_tokens(x, gate, None, RouterConfig(E, k, routed_scaling_factor=2.446))
    return x, w13, w2, weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 300, 2048])
def test_gpu_routing_kernel_equals_the_torch_path_at_kimi_linear_sizes(T):
    """Compiled (not the interpreter), at each rows-per-program choice (1 at decode sizes, 2 at
    300 tokens, 16 at prefill's): bf16 hidden states, 256 experts, top 8, the correction bias and
    the shared expert's column. Weights within the GPU exp's rounding of torch's sigmoid."""
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 2304, device="cuda", generator=g).bfloat16()
    gate = torch.randn(256, 2304, device="cuda", generator=g) * 2304**-0.5
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    cfg = RouterConfig(256, 8, routed_scaling_factor=2.446)
    got_w, got_ids = route_tokens(x, gate, bias, cfg, use_kernel=True, extra_expert=256)
    want_w, want_ids = route_tokens(x, gate, bias, cfg, use_kernel=False, extra_expert=256)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_shared_expert_as_expert_at_kimi_linear_sizes(T):
    """Decode's path (layers/moe): the shared expert (width 1024) as expert 256 inside the fused
    kernels, bf16, against the fp32 reference of routed experts plus the shared MLP."""
    from kdaserve.ops.activation.swiglu import swiglu_reference
    from kdaserve.ops.moe.fused import moe_experts_fused

    x, w13, w2, weights, ids = _kimi_linear_step(T, seed=6)
    s13, s2 = experts(1, 2304, 1024, device="cuda", dtype=torch.bfloat16, seed=7)
    s13, s2 = s13[0].contiguous(), s2[0].contiguous()
    ext_w = torch.cat([weights, torch.ones(T, 1, device="cuda")], 1)
    ext_ids = torch.cat([ids, torch.full((T, 1), 256, device="cuda")], 1)
    got = moe_experts_fused(x, w13, w2, ext_w, ext_ids, shared=(s13, s2))
    xf = x.float()
    want = moe_experts_reference(xf, w13.float(), w2.float(), weights, ids) + swiglu_reference(xf @ s13.float().T) @ s2.float().T
    assert_rel_close(got.float(), want, 1e-2, f"fused MoE + shared expert bf16 T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gpu_fused_at_kimi_linear_sizes(T):
    from kdaserve.ops.moe.fused import moe_experts_fused

    x, w13, w2, weights, ids = _kimi_linear_step(T, seed=4)
    got = moe_experts_fused(x, w13, w2, weights, ids)
    want = moe_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert_rel_close(got.float(), want, 1e-2, f"fused MoE bf16 T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 256, 512, 1000, 8192])
def test_gpu_triton_alignments_equal_the_torch_path(T):
    """Compiled (not the interpreter): the kernels' tables equal the torch path's (the per-expert
    kernel up to its size, the blocks path at every size, and the path chosen by default), on the
    router's own choices (256 experts, top 8), for every block size fused MoE picks."""
    E, k, hidden = 256, 8, 2304
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, hidden, device="cuda", generator=g).bfloat16()
    gate = torch.randn(E, hidden, device="cuda", generator=g) * hidden**-0.5
    _, ids = route_tokens(x, gate, None, RouterConfig(E, k))
    for block_m in (16, 32, 64, 128):
        want = align_to_experts(ids, E, block_m, path="torch")
        for path in ("per_expert", "blocks", None) if T * k <= PER_EXPERT_MAX_SLOTS else ("blocks", None):
            got = align_to_experts(ids, E, block_m, path=path)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (block_m, path)
        if T * (k + 1) <= PER_EXPERT_MAX_SLOTS:   # the shared expert's column (layers/moe at decode)
            with_shared = torch.cat([ids, torch.full_like(ids[:, :1], E)], 1)
            want = align_to_experts(with_shared, E + 1, block_m, path="torch")
            for path in ("per_expert", "blocks", None):
                got = align_to_experts(with_shared, E, block_m, path=path, extra_expert=True)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (block_m, path, "shared")
