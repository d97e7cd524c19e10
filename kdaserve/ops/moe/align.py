"""Grouping a step's (token, expert) pairs by expert for the grouped GEMM, on the device.

A step routes T tokens to k experts each: S = T*k slots, slot s = token s // k, choice s % k.
The slots are sorted by expert and each expert's run is padded to a multiple of `block_m`, so a
program of the grouped GEMM takes `block_m` consecutive sorted entries that all belong to one
expert. Padding entries hold S (no slot). The number of blocks is bounded on the host without
looking at the routing (S + min(S, E) * (block_m - 1) entries), so the grid never depends on the
data: no device->host sync, and a CUDA graph can capture it; blocks past the end get expert -1
and return at once.

Three implementations with identical results (slots of one expert in slot order):

- up to PER_EXPERT_MAX_SLOTS slots on a GPU (decode, short prefill chunks): one launch of one
  program per expert, each reading the whole step into a histogram (so it knows every run's
  start) and placing only its own expert's slots: no serial walk over the slots, so its time
  barely grows with them (an H200 at Kimi-Linear's 256 experts: 0.003-0.012 ms at 9-2304
  slots, 1.8-14x faster than the blocks path; docs/perf-notes.md);
- past PER_EXPERT_MAX_SLOTS on a GPU (prefill), three launches over blocks of slots: each block
  counts its slots per expert; one program turns the counts into every (block, expert)'s first
  destination (the experts' padded starts plus the same expert's slots in the blocks before) and
  names each block's expert; each block then places its slots (rank within the block by a
  cumulative sum of the one-hot tile). Three launches instead of the torch path's sort and ~12
  launches, which with the sum over k took 12% of a prefill MoE call at 8K tokens
  (docs/perf-notes.md);
- the torch path (a stable sort): CPUs, and the definition the kernels are tested against.

`extra_expert`: expert id `num_experts` is one more expert (the shared expert run with the routed
ones, layers/moe.py at decode), its run after every other: the paths take it as one more expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.compile_ahead import compiling_ahead

PER_EXPERT_MAX_SLOTS = 4096   # one tile of slots per program (the histogram's input)
ALIGN_PATHS = ("per_expert", "blocks", "torch")


def max_sorted_entries(num_slots: int, num_experts: int, block_m: int) -> int:
    n = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-n // block_m) * block_m


# S, n, E and BM are runtime values Triton does not specialize on (a multiple of 16 or not), so
# one compile per slot tile S_P serves every step size, expert count under E_P and block size.
@triton.jit(do_not_specialize=["S", "n", "E", "BM"])
def _align_per_expert_kernel(ids_ptr, sorted_ptr, block_experts_ptr, S, n, E, BM,
                             E_P: tl.constexpr, S_P: tl.constexpr, FILL: tl.constexpr):
    """Program e < E: every slot of the step (S <= S_P) into a histogram over the experts, so each
    program knows every run's padded start; it places its own expert's slots (rank: a cumulative
    sum over the slots, so slot order), fills its run's padding with S and names its run's blocks.
    Program E fills the table past the last run (S, and -1 for its blocks). E_P > E: masked lanes
    and the spare bins count nothing."""
    e = tl.program_id(0)
    offs = tl.arange(0, S_P)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=E).to(tl.int32)
    bins = tl.arange(0, E_P)
    counts = tl.where(bins < E, tl.histogram(ids, E_P, mask=offs < S), 0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    if e < E:
        start = tl.sum(tl.where(bins == e, ends - padded, 0), 0)
        count = tl.sum(tl.where(bins == e, counts, 0), 0)
        run = (count + BM - 1) // BM * BM
        mine = ((ids == e) & (offs < S)).to(tl.int32)
        tl.store(sorted_ptr + start + tl.cumsum(mine, 0) - mine, offs, mask=mine != 0)
        for p0 in range(start + count, start + run, FILL):   # the run's padding: under BM entries
            pad = p0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + pad, tl.full([FILL], 0, tl.int32) + S, mask=pad < start + run)
        for b0 in range(0, run // BM, FILL):
            blocks = start // BM + b0 + tl.arange(0, FILL)
            tl.store(block_experts_ptr + blocks, tl.full([FILL], 0, tl.int32) + e, mask=blocks < (start + run) // BM)
    else:
        total = tl.sum(padded, 0)
        for p0 in range(total, n, FILL):
            entries = p0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + entries, tl.full([FILL], 0, tl.int32) + S, mask=entries < n)
        for b0 in range(total // BM, n // BM, FILL):
            blocks = b0 + tl.arange(0, FILL)
            tl.store(block_experts_ptr + blocks, tl.full([FILL], -1, tl.int32), mask=blocks < n // BM)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, S, n, PER_PROGRAM, FILL_PER_PROGRAM,
                        E: tl.constexpr, E_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program b: the slots [b * PER_PROGRAM, +PER_PROGRAM) counted per expert into counts[b], and
    its share of the sorted table filled with S (padding; the placement launch overwrites the
    real entries after this one has finished)."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_P)
    counts = tl.zeros([E_P], tl.int32)
    lo = b * PER_PROGRAM
    for s0 in range(0, PER_PROGRAM, BLOCK_S):
        offs = lo + s0 + tl.arange(0, BLOCK_S)
        e = tl.load(ids_ptr + offs, mask=(offs < S) & (s0 + tl.arange(0, BLOCK_S) < PER_PROGRAM), other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + b * E_P + experts, counts)
    fill = b * FILL_PER_PROGRAM
    for p0 in range(0, FILL_PER_PROGRAM, BLOCK_S):
        offs = fill + p0 + tl.arange(0, BLOCK_S)
        keep = (offs < n) & (p0 + tl.arange(0, BLOCK_S) < FILL_PER_PROGRAM)
        tl.store(sorted_ptr + offs, tl.full([BLOCK_S], 0, tl.int32) + S, mask=keep)


@triton.jit
def _align_offsets_kernel(counts_ptr, base_ptr, block_experts_ptr, NB, n,
                          E: tl.constexpr, E_P: tl.constexpr, BM: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_B: tl.constexpr):
    """One program: each expert's padded run start, then base[b, e] = that start + expert e's
    slots in the blocks before b (the first destination of block b's slots of expert e), BLOCK_B
    blocks at a time (a cumulative sum down the tile), and each block of BM sorted entries' expert."""
    experts = tl.arange(0, E_P)
    rows = tl.arange(0, BLOCK_B)
    totals = tl.zeros([E_P], tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        r = b0 + rows
        totals += tl.sum(tl.load(counts_ptr + r[:, None] * E_P + experts[None, :], mask=(r < NB)[:, None], other=0), 0)
    padded = (totals + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    running = ends - padded
    for b0 in range(0, NB, BLOCK_B):
        r = b0 + rows
        c = tl.load(counts_ptr + r[:, None] * E_P + experts[None, :], mask=(r < NB)[:, None], other=0)
        tl.store(base_ptr + r[:, None] * E_P + experts[None, :], tl.cumsum(c, 0) - c + running[None, :],
                 mask=(r < NB)[:, None])
        running += tl.sum(c, 0)
    for b0 in range(0, n // BM, BLOCK_S):   # a block's expert: how many runs end at or before its start
        blocks = b0 + tl.arange(0, BLOCK_S)
        owner = tl.sum(((ends[None, :] <= (blocks * BM)[:, None]) & (experts < E)[None, :]).to(tl.int32), 1)
        tl.store(block_experts_ptr + blocks, tl.where(owner < E, owner, -1), mask=blocks < n // BM)


@triton.jit
def _align_place_kernel(ids_ptr, base_ptr, sorted_ptr, S, PER_PROGRAM,
                        E_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program b: its slots at base[b, e] + their rank among its earlier slots of expert e."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_P)
    placed = tl.load(base_ptr + b * E_P + experts)
    lo = b * PER_PROGRAM
    for s0 in range(0, PER_PROGRAM, BLOCK_S):
        offs = lo + s0 + tl.arange(0, BLOCK_S)
        ok = (offs < S) & (s0 + tl.arange(0, BLOCK_S) < PER_PROGRAM)
        e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(hot, 0) - hot + placed[None, :]
        dest = tl.sum(hot * rank, 1)
        tl.store(sorted_ptr + dest, offs, mask=ok)
        placed += tl.sum(hot, 0)


def align_to_experts(ids: torch.Tensor, num_experts: int, block_m: int, *,
                     path: str | None = None, extra_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_slots [n] int32, block_experts [n // block_m] int32, -1 past the end).
    `path`: one of ALIGN_PATHS (the module says when each runs); None picks by device and size.
    `extra_expert`: id `num_experts` is one more expert (the module says how it is counted)."""
    S = ids.numel()
    if path is None:
        path = "torch" if not ids.is_cuda or S == 0 else "per_expert" if S <= PER_EXPERT_MAX_SLOTS else "blocks"
    if path not in ALIGN_PATHS:
        raise ValueError(f"alignment path {path!r}: expected one of {ALIGN_PATHS}")
    num_experts += extra_expert   # every path takes it as an expert like the rest
    if path == "blocks":
        return _align_by_blocks(ids, num_experts, block_m)
    if path == "per_expert":
        if S > PER_EXPERT_MAX_SLOTS:
            raise ValueError(f"the per-expert alignment reads a step's {S} slots in one tile; it takes at most "
                             f"{PER_EXPERT_MAX_SLOTS} (larger steps: path 'blocks')")
        return _align_per_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1).to(torch.int64)
    S = flat.numel()
    dev = flat.device
    n = max_sorted_entries(S, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)           # slots grouped by expert, in slot order
    expert_of_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(S, device=dev) - first_of_expert[expert_of_sorted]
    sorted_slots = torch.full((n,), S, dtype=torch.int32, device=dev)
    sorted_slots[starts[expert_of_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, n, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_slots, block_experts


def _kernel_inputs(ids: torch.Tensor, num_experts: int, block_m: int):
    """What both Triton paths start from: the ids flat and contiguous, their count S, the table's
    length n, the expert axis padded to a power of two, the two output tables (junk until the
    kernels write them) and the slots per step of a [slots, experts] one-hot tile (8K elements)."""
    interpreter_compat.install()
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    S = flat.numel()
    n = max_sorted_entries(S, num_experts, block_m)
    E_P = max(16, triton.next_power_of_2(num_experts))
    sorted_slots = torch.empty(n, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(n // block_m, dtype=torch.int32, device=ids.device)
    return flat, S, n, E_P, sorted_slots, block_experts, max(16, min(64, 8192 // E_P))


def _align_per_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat, S, n, _, sorted_slots, block_experts, _ = _kernel_inputs(ids, num_experts, block_m)
    tile = max(16, triton.next_power_of_2(S))
    # A compile-ahead pass (engine warm-up) compiles every slot tile, so that a step of a new size
    # class in serving (a short prefill chunk, a larger batch) does not stall on a compile.
    tiles = _PER_EXPERT_TILES if compiling_ahead() else (tile,)
    for s_p in tiles:
        _align_per_expert_kernel[(num_experts + 1,)](
            flat, sorted_slots, block_experts, S, n, num_experts, block_m,
            E_P=triton.next_power_of_2(num_experts + 1), S_P=s_p, FILL=256, num_warps=4)
    return sorted_slots, block_experts


_PER_EXPERT_TILES = tuple(16 << i for i in range((PER_EXPERT_MAX_SLOTS // 16).bit_length()))


# Slots per program of the block-parallel path: enough programs to fill a GPU at prefill sizes
# (8K tokens x 8 choices: 128 programs), few enough that the offsets program's serial walk over
# them stays short.
SLOTS_PER_PROGRAM = 512


def _align_by_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat, S, n, E_P, sorted_slots, block_experts, block_s = _kernel_inputs(ids, num_experts, block_m)
    nb = max(1, triton.cdiv(S, SLOTS_PER_PROGRAM))
    per_program = triton.cdiv(S, nb) if S else 1
    counts = torch.empty(nb, E_P, dtype=torch.int32, device=ids.device)
    base = torch.empty(nb, E_P, dtype=torch.int32, device=ids.device)
    _align_count_kernel[(nb,)](flat, counts, sorted_slots, S, n, per_program, triton.cdiv(n, nb),
                               E=num_experts, E_P=E_P, BLOCK_S=block_s, num_warps=4)
    _align_offsets_kernel[(1,)](counts, base, block_experts, nb, n, E=num_experts, E_P=E_P, BM=block_m,
                                BLOCK_S=block_s, BLOCK_B=max(2, min(16, 4096 // E_P)), num_warps=4)
    _align_place_kernel[(nb,)](flat, base, sorted_slots, S, per_program, E_P=E_P, BLOCK_S=block_s, num_warps=4)
    return sorted_slots, block_experts
