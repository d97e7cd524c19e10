"""Work tables of one flash prefill, built on the device in one launch (no device->host sync).

Chunks: every sequence is cut into C-token chunks that start at the sequence's first token, so a
chunk never straddles two sequences. Global chunk j belongs to sequence chunk_seq[j] (-1 past the
end) and starts at token chunk_tok[j]; a sequence's chunks are consecutive ids.

Segments: every sequence is also cut into segments of SL tokens (SL a multiple of C; one segment
per sequence when not segmenting). Segment s covers tokens [seg_tok[s], seg_end[s]) and its first
chunk is seg_chunk[s]. seq_seg0[n] .. seq_seg0[n+1] are the
segments of sequence n. A sequence of 0 tokens still gets one (empty) segment, so its state is
written exactly as the reference writes it.

The grid of the table kernel spans the id ranges; each program loads all of cu_seqlens (one block of
next_pow2(N) entries: N is a batch's sequence count), forms the prefix sums and finds the sequence
of each of its ids by counting, a [BLOCK_J, BLOCK_N] comparison instead of a dependent binary
search. No loop has a bound passed as an argument (the interpreter cannot iterate over one).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdaserve.ops.kda.host_tables import host_offsets

TILE = 2048  # BLOCK_J x BLOCK_N comparisons per program (registers, not spills)
_ALIGN_INTS = 32  # 128 bytes of int32


# The counts change with every step; specializing on them (1 / multiple of 16 / other) would compile
# up to 3^4 variants of this kernel while serving, past the engine's warm-up. They are only
# compared against, so nothing is lost.
@triton.jit(do_not_specialize=["N", "n_chunk_ids", "n_seg_ids", "SL"])
def flash_plan_kernel(
    cu_ptr, N,
    chunk_seq_ptr, chunk_tok_ptr, n_chunk_ids,
    seg_seq_ptr, seg_tok_ptr, seg_end_ptr, seg_chunk_ptr, n_seg_ids, seq_seg0_ptr,
    SL,
    C: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
    m = tl.arange(0, BLOCK_N)
    mk = m < N
    lo = tl.load(cu_ptr + m, mask=mk, other=0)
    hi = tl.load(cu_ptr + m + 1, mask=mk, other=0)
    ln = hi - lo
    nch = (ln + C - 1) // C
    nsg = tl.where(mk, tl.maximum((ln + SL - 1) // SL, 1), 0)
    end_c = tl.cumsum(nch, axis=0)   # chunk ids of sequence m end (exclusive) here
    end_s = tl.cumsum(nsg, axis=0)
    total_c = tl.sum(nch, axis=0)
    total_s = tl.sum(nsg, axis=0)
    tl.store(seq_seg0_ptr + m, end_s - nsg, mask=mk & (pid == 0))
    tl.store(seq_seg0_ptr + N, total_s, mask=pid == 0)

    # Sequence of id j = number of sequences that end at or before j (empty ones included).
    le_c = (end_c[None, :] <= j[:, None]) & mk[None, :]
    cnt_c = tl.sum(le_c.to(tl.int32), axis=1)
    beg_c = tl.max(tl.where(le_c, end_c[None, :], 0), axis=1)
    ok_c = j < total_c
    n_c = tl.where(ok_c, cnt_c, 0)
    tl.store(chunk_seq_ptr + j, tl.where(ok_c, n_c, -1), mask=j < n_chunk_ids)
    tl.store(chunk_tok_ptr + j, tl.where(ok_c, tl.load(cu_ptr + n_c) + (j - beg_c) * C, 0), mask=j < n_chunk_ids)

    # end_s is strictly increasing (every sequence has >= 1 segment), so "ends at or before
    # segment j" is exactly "comes before j's sequence": chk_s sums the chunks before it.
    le_s = (end_s[None, :] <= j[:, None]) & mk[None, :]
    cnt_s = tl.sum(le_s.to(tl.int32), axis=1)
    beg_s = tl.max(tl.where(le_s, end_s[None, :], 0), axis=1)
    chk_s = tl.sum(tl.where(le_s, nch[None, :], 0), axis=1)
    ok_s = j < total_s
    n_s = tl.where(ok_s, cnt_s, 0)
    k = j - beg_s
    tok0 = tl.load(cu_ptr + n_s) + k * SL
    tok1 = tl.minimum(tok0 + SL, tl.load(cu_ptr + n_s + 1))
    ms = j < n_seg_ids
    tl.store(seg_seq_ptr + j, tl.where(ok_s, n_s, -1), mask=ms)
    tl.store(seg_tok_ptr + j, tl.where(ok_s, tok0, 0), mask=ms)
    tl.store(seg_end_ptr + j, tl.where(ok_s, tok1, 0), mask=ms)
    tl.store(seg_chunk_ptr + j, tl.where(ok_s, chk_s + k * (SL // C), 0), mask=ms)


@dataclass(slots=True)
class FlashPlan:
    chunk: int
    segment_len: int          # SL; >= every sequence's length when not segmenting
    segmented: bool
    n_chunk_ids: int          # grid size over chunks (an upper bound without a host cu_seqlens)
    n_seg_ids: int
    chunk_seq: torch.Tensor
    chunk_tok: torch.Tensor
    seg_seq: torch.Tensor
    seg_tok: torch.Tensor
    seg_end: torch.Tensor
    seg_chunk: torch.Tensor
    seq_seg0: torch.Tensor


def build_plan(
    cu_seqlens: torch.Tensor, T: int, N: int, chunk: int, segment_len: int | None,
    cu_seqlens_cpu: torch.Tensor | None,
) -> FlashPlan:
    """Tables for chunks of `chunk` tokens and segments of `segment_len` tokens (None: one segment
    per sequence). Sizes come from host values only: T, N and, when given, the host cu_seqlens."""
    lens = seq_lens(host_offsets(cu_seqlens_cpu)) if cu_seqlens_cpu is not None else None
    return _build_plan(cu_seqlens, T, N, chunk, segment_len, lens)


def _build_plan(
    cu_seqlens: torch.Tensor, T: int, N: int, chunk: int, segment_len: int | None, lens: tuple[int, ...] | None,
) -> FlashPlan:
    segmented = segment_len is not None
    SL = segment_len if segmented else max(T, 1)
    SL = triton.cdiv(SL, chunk) * chunk
    if lens is not None:
        n_chunk_ids = sum(-(-x // chunk) for x in lens)
        n_seg_ids = sum(max(-(-x // SL), 1) for x in lens)
    else:
        n_chunk_ids = triton.cdiv(T, chunk) + N
        n_seg_ids = triton.cdiv(T, SL) + N
    dev = cu_seqlens.device
    # Every table starts 128-byte aligned: Triton specializes pointer arguments on 16-byte
    # alignment, so unpadded sections (offsets of n_chunk_ids ints) would give the kernels that
    # read them a second compiled variant for some steps and not others.
    sizes = [n_chunk_ids, n_chunk_ids, n_seg_ids, n_seg_ids, n_seg_ids, n_seg_ids, N + 1]
    padded = [-(-s // _ALIGN_INTS) * _ALIGN_INTS for s in sizes]
    ints = torch.empty(sum(padded), dtype=torch.int32, device=dev)
    chunk_seq, chunk_tok, seg_seq, seg_tok, seg_end, seg_chunk, seq_seg0 = (
        part[:s] for part, s in zip(torch.split(ints, padded), sizes)
    )
    block_n = max(triton.next_power_of_2(N), 16)  # a handful of compiled variants in practice
    block_j = max(min(TILE // block_n, 256), 16)
    grid = (max(triton.cdiv(max(n_chunk_ids, n_seg_ids), block_j), 1),)
    flash_plan_kernel[grid](
        cu_seqlens, N, chunk_seq, chunk_tok, n_chunk_ids, seg_seq, seg_tok, seg_end, seg_chunk, n_seg_ids,
        seq_seg0, SL, C=chunk, BLOCK_J=block_j, BLOCK_N=block_n,
    )
    return FlashPlan(
        chunk, SL, segmented, n_chunk_ids, n_seg_ids, chunk_seq, chunk_tok, seg_seq, seg_tok, seg_end, seg_chunk, seq_seg0
    )


def choose_segment_len(
    T: int, N: int, H: int, D: int, chunk: int, cu_seqlens_cpu: torch.Tensor | None, num_sms: int, cfg,
) -> int | None:
    """Segment length for sequence parallelism, or None to run each sequence in one program.

    A small cost model (config.py's cost_* fields, in microseconds, from measurements): the
    unsegmented recurrence runs its chains in ceil(pairs / slots) rounds of (chunks x step time);
    segmenting into G pieces runs 2G - 1 chains per (sequence, head, V-slice) that are G times
    shorter, plus G scan steps and a per-token-head cost (o_loc and q~ through the workspace and
    the correction pass). Sequences of unknown length (no host cu_seqlens) count as equal.

    This runs on the host, once per step: the search
    over G costs up to ~1 ms of Python for a 64K-token prompt, more than the GPU time of a short
    prefill: it runs once per step (flash_step_plan), never once per layer."""
    if N == 0 or N * H >= num_sms * cfg.recur_ctas_per_sm:
        return None  # the unsegmented pass already has a chain for every SM (N is small below)
    if cu_seqlens_cpu is not None:
        lens = seq_lens(host_offsets(cu_seqlens_cpu))
    else:
        lens = (-(-T // N),) * N
    return _best_segment_len(lens, H, D, chunk, num_sms, cfg)


def seq_lens(offsets: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b - a for a, b in itertools.pairwise(offsets))


def full_rounds(lens, H: int, chunk: int, num_sms: int, cfg) -> int:
    """Chunk steps the unsegmented recurrence takes end to end: the longest chain, or more when
    (sequence, head) pairs outnumber the programs the GPU holds at once."""
    chunks = [-(-x // chunk) for x in lens]
    return max(max(chunks), -(-(sum(chunks) * H) // (num_sms * cfg.recur_ctas_per_sm)))


def segmented_rounds(lens, H: int, D: int, chunk: int, seg: int, num_sms: int, cfg) -> tuple[int, int]:
    """(chunk steps of the map pass end to end, segments of the longest sequence) for segments of
    `seg` tokens: 2G - 1 chains per (sequence, head, V-slice) of G segments (a sequence's first
    segment needs no identity map), each seg / chunk steps long, in rounds of the resident programs."""
    nv = max(D // cfg.seg_block_v, 1)
    pieces = [max(-(-x // seg), 1) for x in lens]
    programs = H * nv * (2 * sum(pieces) - len(pieces))
    return -(-programs // (num_sms * cfg.seg_ctas_per_sm)) * (seg // chunk), max(pieces)


def _best_segment_len(lens: tuple, H: int, D: int, chunk: int, num_sms: int, cfg) -> int | None:
    longest = max(lens)
    best_len = None
    if longest >= cfg.seg_min_len:
        best = full_rounds(lens, H, chunk, num_sms, cfg) * cfg.cost_step_full_us
        extra = sum(lens) * H * cfg.cost_token_head_seg_ns * 1e-3
        for G in range(2, 129):
            seg = -(-(-(-longest // G)) // chunk) * chunk
            if seg < cfg.seg_min_tokens:
                break
            steps, pieces = segmented_rounds(lens, H, D, chunk, seg, num_sms, cfg)
            t = steps * cfg.cost_step_seg_us + pieces * cfg.cost_scan_step_us + extra
            if t < best:
                best, best_len = t, seg
    return best_len
