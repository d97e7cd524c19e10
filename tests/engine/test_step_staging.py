"""A step's metadata through the staging buffer (one packed copy) equals the same metadata made
array by array, for the eager path and for the CUDA graphs' static inputs (on the CPU: the
packing, padding and views are the same code on both devices)."""

import numpy as np
import pytest
import torch

from kdaserve.engine.cuda_graphs import DecodeStaticInputs
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.sampling_params import SamplingParams
from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.staging import StagingRing
from kdaserve.engine.step_inputs import build_host_step, to_device_step
from kdaserve.layers.kda import KDALayer
from kdaserve.models.tokenizer import ByteTokenizer

BLOCK = 4
CPU = torch.device("cpu")


def _backends(num_spec_tokens: int = 0):
    """The reference pair, which builds each step's KDA part from the staged tensors."""
    return KDALayer.build(16, 2, 8, num_spec_tokens=num_spec_tokens, prefill_backend="reference",
                          decode_backend="reference", device="cpu").backends


def _seq(num_tokens: int, computed: int, slot: int, first_block: int) -> Sequence:
    s = Sequence(f"r{slot}", [(7 * slot + j) % 50 for j in range(num_tokens)], SamplingParams(),
                 IncrementalDetokenizer(ByteTokenizer(), []))
    s.num_computed_tokens, s.state_slot = computed, slot
    s.block_table = [first_block + b for b in range(-(-(computed + 1) // BLOCK) + 2)]
    return s


def _decodes(n: int, offset: int = 0) -> list[Sequence]:
    # Lengths differ so the block tables differ in length; each decode samples its last token.
    return [_seq(5 + 3 * i + offset, 4 + 3 * i + offset, i + 1, 10 * (i + 1)) for i in range(n)]


def _by_arrays(step):
    """The old way: one tensor per array (what the packed copy must reproduce)."""
    cu = np.concatenate([[0], np.cumsum(step.prefill_query_lens)]).astype(np.int32)
    return {
        "input_ids": torch.from_numpy(step.input_ids), "positions": torch.from_numpy(step.positions),
        "slot_mapping": torch.from_numpy(step.slot_mapping),
        "decode_state_indices": torch.from_numpy(step.decode_state_indices),
        "decode_context_lens": torch.from_numpy(step.decode_context_lens),
        "decode_block_tables": torch.from_numpy(step.decode_block_tables),
        "cu": torch.from_numpy(cu), "prefill_state_indices": torch.from_numpy(step.prefill_state_indices),
        "has_state": torch.from_numpy(step.prefill_has_initial_state), "kv_rows": torch.from_numpy(step.prefill_kv_rows),
    }


def _eq(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize("num_decodes, prefill_lens", [(3, []), (0, [5, 1]), (2, [3]), (1, [7, 2, 4])])
def test_eager_context_equals_one_copy_per_array(num_decodes, prefill_lens):
    decodes = _decodes(num_decodes)
    prefills = [_seq(n + 2 * i, 2 * i, 20 + i, 100 + 10 * i) for i, n in enumerate(prefill_lens)]
    batch = ScheduledBatch(decodes=decodes, prefills=prefills, num_new_tokens=list(prefill_lens))
    step = build_host_step(batch, BLOCK)
    assert step.decode_width % 16 == 0   # one Triton variant of the paged-attention row stride
    want = _by_arrays(step)
    ring = StagingRing(8, CPU)   # too small: grows on the first step
    backends = _backends()
    for _ in range(2):          # a reused staging buffer gives the same
        dev = to_device_step(step, CPU, ring, backends)
        kda, attn = dev.context.kda, dev.context.attn
        assert kda.built_by is backends and kda.num_decodes == num_decodes
        assert kda.num_prefill_tokens == sum(prefill_lens)
        assert _eq(dev.input_ids, want["input_ids"]) and _eq(dev.positions, want["positions"])
        assert _eq(attn.slot_mapping, want["slot_mapping"])
        if num_decodes:
            assert _eq(kda.decode.state_indices, want["decode_state_indices"])
            assert _eq(attn.decode_context_lens, want["decode_context_lens"])
            assert _eq(attn.decode_block_tables, want["decode_block_tables"])
        else:
            assert kda.decode is None and attn.decode_block_tables is None
        if prefill_lens:
            seqs = kda.prefill.seqs
            assert _eq(seqs.cu_seqlens, want["cu"]) and _eq(seqs.cu_seqlens_cpu, want["cu"])
            assert _eq(seqs.state_indices, want["prefill_state_indices"])
            assert _eq(seqs.has_initial_state, want["has_state"]) and _eq(attn.prefill_kv_rows, want["kv_rows"])
        else:
            assert kda.prefill is None and attn.prefill_kv_rows is None
        rows = step.logits.sample_rows
        if rows == list(range(len(rows))):
            assert dev.sample_rows is None
        else:
            assert dev.sample_rows.tolist() == rows


def test_graph_static_inputs_follow_changing_batch_sizes():
    """Sizes 3, 4, 1, 2, 3 into buckets of 4, 4, 1, 2, 4: real rows equal the step, padding rows
    point at the null slot, the null block and the trash row, whatever a larger step left there."""
    trash, width = 999, 6
    static = DecodeStaticInputs(4, width, trash, CPU)
    for k, (n, bs) in enumerate([(3, 4), (4, 4), (1, 1), (2, 2), (3, 4)]):
        step = build_host_step(ScheduledBatch(decodes=_decodes(n, offset=k)), BLOCK, decode_width=width)
        want = _by_arrays(step)
        assert static.stage(step, bs) is None
        real, pad = slice(0, n), slice(n, bs)
        assert _eq(static.input_ids[real], want["input_ids"]) and _eq(static.positions[real], want["positions"])
        assert _eq(static.views["slot_mapping"][real], want["slot_mapping"])
        assert _eq(static.views["decode_state_indices"][real], want["decode_state_indices"])
        assert _eq(static.views["decode_context_lens"][real], want["decode_context_lens"])
        assert _eq(static.views["decode_block_tables"][real], want["decode_block_tables"])
        assert (static.views["decode_state_indices"][pad] == 0).all() and (static.views["slot_mapping"][pad] == trash).all()
        # Padding rows point at the null block in every column the step uses; later columns may
        # keep an older step's block ids, which no kernel reads (they stop at the context length).
        used = max(len(s.block_table) for s in _decodes(n, offset=k))
        assert (static.views["decode_context_lens"][pad] == 1).all()
        assert (static.views["decode_block_tables"][pad][:, :used] == 0).all()
        assert (static.input_ids[pad] == 0).all() and (static.positions[pad] == 0).all()


def test_graph_sample_rows_are_staged_when_not_leading():
    # The middle sequence still has an unprocessed token after this one (a recomputed prompt
    # advancing one token at a time): its row does not sample.
    seqs = _decodes(3)
    seqs[1].token_ids.append(3)
    step = build_host_step(ScheduledBatch(decodes=seqs), BLOCK, decode_width=6)
    assert step.logits.sample_rows == [0, 2]
    static = DecodeStaticInputs(4, 6, 999, CPU)
    rows = static.stage(step, 4)
    assert rows.tolist() == [0, 2] and rows.dtype == torch.int64


def _verifying(n: int, S: int, offset: int = 0) -> list[Sequence]:
    """n sequences in a verify step of S+1 tokens: sequence i carries i % (S+1) drafts."""
    out = _decodes(n, offset)
    for i, s in enumerate(out):
        s.spec_slots = [100 + S * i + t for t in range(S)]
        s.num_accepted = 1 + (i % (S + 1))
        s.draft_token_ids = [40 + t for t in range(i % (S + 1))]
        need = -(-(s.num_computed_tokens + 1 + len(s.draft_token_ids)) // BLOCK)
        s.block_table += [500 + 10 * i + b for b in range(max(0, need - len(s.block_table)))]
    return out


def _verify_rows_by_hand(seqs, S, trash):
    """Per sequence: its last token and drafts at positions p.., then padding rows (token 0,
    position p, the trash row, context p+1); every block table repeated for its S+1 rows."""
    ids, pos, slots, ctx, tables, sample = [], [], [], [], [], []
    for i, s in enumerate(seqs):
        p, d = s.num_computed_tokens, s.draft_token_ids
        for t in range(S + 1):
            real = t <= len(d)
            q = p + t if real else p
            ids.append(([s.token_ids[p], *d][t]) if real else 0)
            pos.append(q)
            slots.append(s.block_table[q // BLOCK] * BLOCK + q % BLOCK if real else trash)
            ctx.append(q + 1 if real else p + 1)
            tables.append(s.block_table)
            if real:
                sample.append(i * (S + 1) + t)
    return ids, pos, slots, ctx, tables, sample


@pytest.mark.parametrize("num_decodes, prefill_lens", [(4, []), (3, [5])])
def test_verify_steps_stage_every_draft_as_a_decode_row(num_decodes, prefill_lens):
    S, trash = 3, 999
    seqs = _verifying(num_decodes, S)
    prefills = [_seq(n + 2, 2, 20, 100) for n in prefill_lens]
    batch = ScheduledBatch(decodes=seqs, prefills=prefills, num_new_tokens=list(prefill_lens), spec_tokens=S)
    step = build_host_step(batch, BLOCK, trash_row=trash)
    ids, pos, slots, ctx, tables, sample = _verify_rows_by_hand(seqs, S, trash)
    nrows = num_decodes * (S + 1)
    assert step.num_decode_tokens == nrows
    assert step.input_ids[:nrows].tolist() == ids and step.positions[:nrows].tolist() == pos
    assert step.slot_mapping[:nrows].tolist() == slots and step.decode_context_lens.tolist() == ctx
    assert step.logits.sample_rows[: len(sample)] == sample
    assert [(g.first_row, g.drafts) for g in step.logits.groups[:num_decodes]] == \
        [(sum(len(x.draft_token_ids) + 1 for x in seqs[:i]), x.draft_token_ids) for i, x in enumerate(seqs)]
    dev = to_device_step(step, CPU, StagingRing(8, CPU), _backends(S))
    kda, attn = dev.context.kda, dev.context.attn
    assert kda.num_decodes == num_decodes and kda.num_decode_tokens == nrows and attn.num_decode_tokens == nrows
    assert kda.decode.spec_state_indices.tolist() == [s.spec_slots + [s.state_slot] for s in seqs]
    assert kda.decode.num_accepted_tokens.tolist() == [s.num_accepted for s in seqs]
    assert kda.decode.state_indices.tolist() == [s.state_slot for s in seqs]
    assert [row[: len(t)].tolist() for row, t in zip(attn.decode_block_tables, tables)] == tables
    if prefill_lens:   # the prefill chunk follows the verify rows
        assert dev.input_ids[nrows:].tolist() == prefills[0].token_ids[2:]


def test_graph_static_inputs_of_verify_steps_pad_whole_sequences():
    S, trash, width = 2, 999, 8
    static = DecodeStaticInputs(4, width, trash, CPU, tokens_per_seq=S + 1)
    for k, (n, bs) in enumerate([(3, 4), (4, 4), (1, 1), (2, 4)]):
        seqs = _verifying(n, S, offset=k)
        step = build_host_step(ScheduledBatch(decodes=seqs, spec_tokens=S), BLOCK, decode_width=width, trash_row=trash)
        ids, pos, slots, ctx, tables, _ = _verify_rows_by_hand(seqs, S, trash)
        static.stage(step, bs)
        real, pad = slice(0, n * (S + 1)), slice(n * (S + 1), bs * (S + 1))
        assert static.input_ids[real].tolist() == ids and static.positions[real].tolist() == pos
        assert static.views["slot_mapping"][real].tolist() == slots and static.views["decode_context_lens"][real].tolist() == ctx
        assert [r[: len(t)].tolist() for r, t in zip(static.views["decode_block_tables"][real], tables)] == tables
        assert static.views["spec_state_indices"][:n].tolist() == [s.spec_slots + [s.state_slot] for s in seqs]
        assert static.views["num_accepted_tokens"][:n].tolist() == [s.num_accepted for s in seqs]
        assert (static.views["decode_state_indices"][n:bs] == 0).all() and (static.views["spec_state_indices"][n:bs] == 0).all()
        assert (static.views["num_accepted_tokens"][n:bs] == 1).all() and (static.views["slot_mapping"][pad] == trash).all()
        used = max(len(t) for t in tables)   # columns past them may hold older block ids (never read)
        assert (static.views["decode_context_lens"][pad] == 1).all()
        assert (static.views["decode_block_tables"][pad][:, :used] == 0).all()


def test_a_step_stages_only_the_block_table_columns_it_uses():
    """At a 1M-token context the tables are 65536 columns wide: a step copies its rows' used
    columns, not the whole width."""
    width = 1 << 16
    static = DecodeStaticInputs(4, width, 999, CPU)
    sent = []
    submit = static.ring.submit
    static.ring.submit = lambda i, dst, nbytes: (sent.append(nbytes), submit(i, dst, nbytes))
    seqs = _decodes(2)
    step = build_host_step(ScheduledBatch(decodes=seqs), BLOCK, decode_width=width)
    static.stage(step, 2)
    used = max(len(s.block_table) for s in seqs)
    assert sent == [static.layout.fields["decode_block_tables"][0] + 2 * used * 4]
    assert [static.views["decode_block_tables"][i, : len(s.block_table)].tolist() for i,
            s in enumerate(seqs)] == [s.block_table for s in seqs]


@pytest.mark.parametrize("m", [1, 3])
def test_graph_capture_builds_its_context_over_the_static_buffers(m):
    """The captured graph's Context is built by the same builder as an eager step's, over the
    static buffers' first bs sequences: views (the replay reads their addresses), never copies.
    The KDA part goes through the pair's build_for_capture, which refuses a backend that cannot be
    captured."""
    import dataclasses

    from kdaserve.engine.step_context import build_context

    static = DecodeStaticInputs(8, 6, 999, CPU, tokens_per_seq=m)
    pair = _backends(m - 1)
    with pytest.raises(ValueError, match="the reference KDA decode backend cannot be captured"):
        build_context(static.views, pair, num_decodes=4, tokens_per_decode=m, for_capture=True)
    capturable = dataclasses.replace(pair.decode, spec=dataclasses.replace(pair.decode.spec, graph_capturable=True))
    pair = dataclasses.replace(pair, decode=capturable)
    ctx = build_context(static.views, pair, num_decodes=4, tokens_per_decode=m, for_capture=True)
    v = static.views
    assert ctx.kda.built_by is pair and ctx.kda.num_decodes == 4 and ctx.kda.num_decode_tokens == 4 * m
    assert ctx.kda.prefill is None and ctx.attn.num_decode_tokens == 4 * m
    seqs = ctx.kda.decode
    assert seqs.state_indices.data_ptr() == v["decode_state_indices"].data_ptr() and seqs.state_indices.shape == (4,)
    if m > 1:
        assert seqs.spec_state_indices.data_ptr() == v["spec_state_indices"].data_ptr()
        assert seqs.spec_state_indices.shape == (4, m) and seqs.num_accepted_tokens.shape == (4,)
    else:
        assert seqs.spec_state_indices is None and seqs.num_accepted_tokens is None
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
        t = getattr(ctx.attn, name)
        assert t.data_ptr() == v[name].data_ptr() and t.shape[0] == 4 * m, name
