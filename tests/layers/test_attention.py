"""Paged full attention against dense causal attention over each whole sequence."""

import pytest
import torch
import torch.nn.functional as F

from kdaserve.layers.attention import paged_attention
from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.rotary import RotaryEmbedding

Hq, Hkv, D, BS = 4, 2, 8, 4


def dense_causal(q, k, v, scale):
    """q, k, v [L, H*, D] of one whole sequence -> [L, Hq, D]."""
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=scale).transpose(0, 1)


def rows(table, start, end):
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


def test_mixed_chunked_steps_match_dense_attention():
    g = torch.Generator().manual_seed(0)
    lens = {"a": 11, "b": 6}
    qkv = {n: [torch.randn(L, h, D, generator=g) for h in (Hq, Hkv, Hkv)] for n, L in lens.items()}
    num_blocks = 9                                        # block 0 null, block 8 the trash block
    k_cache = torch.zeros(num_blocks, BS, Hkv, D)
    v_cache = torch.zeros(num_blocks, BS, Hkv, D)
    tables = {"a": [3, 1, 5], "b": [2, 7]}
    for b in (4, 6):                                      # stale rows of earlier owners: finite junk
        k_cache[b] = 1e4
        v_cache[b] = -1e4
    tables["a"].append(4)                                 # a's unused 4th block holds junk
    trash = 8 * BS
    k_cache[8] = float("nan")
    v_cache[8] = float("nan")
    scale = D**-0.5
    got = {n: torch.full((L, Hq, D), float("nan")) for n, L in lens.items()}
    # (decodes [(name, pos)], prefills [(name, start, n)], padding decode rows)
    steps = [
        ([], [("a", 0, 5), ("b", 0, 5)], 0),
        ([("b", 5)], [("a", 5, 4)], 0),                   # a mixed step: b decodes, a's second chunk
        ([("a", 9), ], [], 2),                            # graph-style padding rows
        ([("a", 10)], [], 0),
    ]
    for decodes, prefills, pad in steps:
        qs, ks, vs, slot_map = [], [], [], []
        tbl_w = 4
        bt, cl = [], []
        for n, p in decodes:
            q, k, v = (t[p : p + 1] for t in qkv[n])
            qs.append(q), ks.append(k), vs.append(v)
            slot_map += rows(tables[n], p, p + 1)
            bt.append(tables[n] + [0] * (tbl_w - len(tables[n])))
            cl.append(p + 1)
        for _ in range(pad):
            qs.append(torch.randn(1, Hq, D, generator=g)), ks.append(torch.full((1, Hkv, D), float("nan")))
            vs.append(torch.full((1, Hkv, D), float("nan")))
            slot_map.append(trash)
            bt.append([0] * tbl_w)
            cl.append(1)
        md = AttentionMetadata(slot_mapping=torch.tensor(slot_map, dtype=torch.int64), num_decode_tokens=len(decodes) + pad)
        if decodes or pad:
            md.decode_block_tables = torch.tensor(bt, dtype=torch.int32)
            md.decode_context_lens = torch.tensor(cl, dtype=torch.int32)
        kv_rows = []
        for n, s, m in prefills:
            q, k, v = (t[s : s + m] for t in qkv[n])
            qs.append(q), ks.append(k), vs.append(v)
            md.slot_mapping = torch.cat([md.slot_mapping, torch.tensor(rows(tables[n], s, s + m))])
            md.prefill_query_lens.append(m)
            md.prefill_context_lens.append(s + m)
            kv_rows += rows(tables[n], 0, s + m)
        md.prefill_kv_rows = torch.tensor(kv_rows, dtype=torch.int64) if prefills else None
        out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, md, scale)
        r = 0
        for n, p in decodes:
            got[n][p] = out[r]
            r += 1
        r += pad
        for n, s, m in prefills:
            got[n][s : s + m] = out[r : r + m]
            r += m
    for n in lens:
        want = dense_causal(*qkv[n], scale)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(k_cache[0]).all() and (k_cache[0] == 0).all(), "the null block must stay untouched"


def test_partial_rotary_leaves_the_tail_alone_and_preserves_norms():
    rope = RotaryEmbedding(head_dim=8, rotary_dim=4, max_position=32, base=10000.0)
    q, k = torch.randn(5, 2, 8), torch.randn(5, 1, 8)
    pos = torch.tensor([0, 3, 7, 7, 31])
    q2, k2 = rope(pos, q, k)
    assert torch.equal(q2[..., 4:], q[..., 4:]) and torch.equal(k2[..., 4:], k[..., 4:])
    torch.testing.assert_close(q2[0], q[0])                                   # position 0: identity
    torch.testing.assert_close(q2[..., :4].norm(dim=-1), q[..., :4].norm(dim=-1))
    # relative property: <rot(q, m), rot(k, n)> depends on m - n only
    a, _ = rope(torch.tensor([5]), q[:1], k[:1])
    b, _ = rope(torch.tensor([9]), k[:1, :1].expand(1, 2, 8), k[:1])
    c, _ = rope(torch.tensor([7]), q[:1], k[:1])
    d, _ = rope(torch.tensor([11]), k[:1, :1].expand(1, 2, 8), k[:1])
    torch.testing.assert_close((a[..., :4] * b[..., :4]).sum(-1), (c[..., :4] * d[..., :4]).sum(-1), rtol=1e-4, atol=1e-5)


def test_rotary_rejects_odd_dims():
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, 3, 16, 10000.0)
