"""Startup warm-up: a few dummy steps through the real model, so that the kernels' JIT
specializations are compiled at startup instead of inside the first requests (measured on the
H200: a fresh process served its first 64 requests 3x slower than the same requests later).

Triton compiles one variant per combination of integer arguments that are 1 or multiples of 16, pointers
aligned to 16 bytes, and launch constants the wrappers derive from the step (block sizes from the number of
sequences, segmented or not from their lengths, ...). The steps below cover: prefills of 1, 16, 32, 64 and 37
tokens; three sequences of different lengths at once; a chunked prompt and its continuation (initial state
read); for p = 4, 8, 16, ... up to max_num_seqs, prefills of p - 1 and p sequences and mixed steps with p - 1,
p and p + 1 decodes (mixed steps run their decodes eagerly, at any batch size, outside the captured graphs'
buckets); pure decode steps (CUDA-graph replays, or eager kernels when graphs are off); the whole token budget
in one sequence and over several (with prefix caching on, again with in-launch checkpoints); greedy,
temperature / top-k / top-p and seeded sampling, log-probs. With speculative decoding every decode step is a
verify step (as in serving), its sequences carrying 0 to S drafts, so the verify kernels, graphs and the
rejection sampler are what gets compiled. Everything is clipped to the token budget, max_num_seqs and
max_model_len; a step that the KV pool cannot hold is skipped. The launchers that make several launches
(flash's prefill, the fused MoE) compile their kernels in parallel on a thread pool before launching them
(ops/compile_ahead.py; $KDASERVE_COMPILE_THREADS=1 compiles each at its first launch instead).

The steps borrow real state slots and KV blocks from the engine's pools and give them back; the
pools are then reset to a fresh pool's order (and must be empty, else this raises). What the steps
leave in those slots and blocks is never read by a later request (a new request starts from no
initial state and writes its KV rows before reading them), and the sampler's generator is restored,
so later requests get exactly the tokens they would get without the warm-up."""

from __future__ import annotations

import logging
import time

from kdaserve.engine.block_manager import BlockManager
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.memory import MemoryPlan
from kdaserve.engine.model_runner import ModelRunner
from kdaserve.engine.sampling_params import SamplingParams
from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence, SequenceStatus
from kdaserve.engine.state_pool import StateSlotPool
from kdaserve.ops.compile_ahead import warm_up_compiles
from kdaserve.ops.kda.types import checkpoint_table_width

log = logging.getLogger("kdaserve.engine")

GREEDY = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
# Off CUDA nothing is compiled (torch ops, or Triton's interpreter), so the engine does not warm up
# there by itself; when asked to (tests), the steps' token budget is capped to keep them cheap.
CPU_TOKEN_CAP = 64


class Warmup:
    def __init__(self, runner: ModelRunner, slots: StateSlotPool, blocks: BlockManager, memory: MemoryPlan, *,
                 vocab_size: int, tokenizer):
        self.runner, self.slots, self.blocks, self.memory, self.tokenizer = runner, slots, blocks, memory, tokenizer
        self.budget = runner.config.max_num_batched_tokens
        if runner.device.type != "cuda":
            self.budget = min(self.budget, CPU_TOKEN_CAP)
        self.max_seqs = runner.config.max_num_seqs
        self.max_model_len = memory.max_model_len
        self.vocab = vocab_size
        self.spec = runner.num_spec_tokens
        self.live: list[Sequence] = []
        self.steps = 0

    # -- sequences ----------------------------------------------------------------------------

    def new(self, prompt_len: int, params: SamplingParams = GREEDY) -> Sequence | None:
        """A dummy request holding a real state slot (None when none is left)."""
        if len(self.live) >= self.max_seqs or self.slots.num_free < self.spec + 1:
            return None
        n = max(1, min(prompt_len, self.max_model_len - 1))
        tokens = [(31 * k + 7 * len(self.live) + 3) % self.vocab for k in range(n)]
        seq = Sequence(f"warmup-{self.steps}-{len(self.live)}", tokens, params,
                       IncrementalDetokenizer(self.tokenizer, []))
        self.slots.assign(seq, self.spec)
        seq.status = SequenceStatus.RUNNING
        self.live.append(seq)
        return seq

    def release(self) -> None:
        for seq in self.live:
            self.slots.release(seq)
            self.blocks.free(seq)
        self.live = []

    # -- steps --------------------------------------------------------------------------------

    def step(self, decodes=(), prefills=(), checkpoints: bool = False) -> bool:
        """One step through the model runner: `decodes` (those ready for one) first, then
        `prefills` [(seq, tokens)], clipped to the budget as the scheduler would. Returns whether
        it ran (False: nothing to run, or the KV pool cannot hold it)."""
        m = self.spec + 1                             # tokens per decode (a verify's with speculation)
        decodes = [s for s in decodes if s is not None and s.num_uncomputed_tokens == 1
                   and s.num_computed_tokens > 0 and s.num_tokens < self.max_model_len][: self.budget // m]
        for k, s in enumerate(decodes):               # 0..S drafts, as many as fit the model length
            s.draft_token_ids = [(5 * k + t) % self.vocab for t in range(min(k % m, self.max_model_len - s.num_tokens - 1))]
        left = self.budget - len(decodes) * m
        chunks = []
        for seq, n in prefills:
            if seq is None or seq in decodes:
                continue
            n = min(n, seq.num_uncomputed_tokens, left)
            # One token with history is a decode for the scheduler; a prefill chunk never is.
            if n > 0 and not (n == 1 and seq.num_computed_tokens > 0):
                chunks.append((seq, n))
                left -= n
        work = [(s, 1 + len(s.draft_token_ids)) for s in decodes] + chunks   # KV rows each needs
        if not work:
            return False
        need = sum(self.blocks.extra_blocks_for(s, s.num_computed_tokens + n) for s, n in work)
        if need > self.blocks.num_free:
            return False
        for s, n in work:
            self.blocks.grow(s, s.num_computed_tokens + n)
        batch = ScheduledBatch(decodes=decodes, prefills=[s for s, _ in chunks], num_new_tokens=[n for _, n in chunks],
                               spec_tokens=self.spec)
        if checkpoints:
            self.with_checkpoints(batch)
        result = self.runner.execute(batch)
        for s in decodes:
            s.num_computed_tokens += 1
        for s, n in chunks:
            s.num_computed_tokens += n
        for seq, index, entry in result.prompt_logprobs:
            if index == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(entry)
        if result.accepted is not None:
            for a in result.accepted:
                if a.seq in decodes:                  # a verify: its accepted drafts are computed too
                    a.seq.num_computed_tokens += a.num_accepted_drafts
                    a.seq.num_accepted = 1 + a.num_accepted_drafts
                a.seq.token_ids.extend(a.tokens)
                a.seq.draft_token_ids = []
        for seq, token in zip(result.sample_seqs if result.accepted is None else (), result.sampled.token_ids):
            seq.token_ids.append(token)
        self.steps += 1
        return True

    def prefill(self, *seqs: Sequence | None, checkpoints: bool = False) -> bool:
        return self.step(prefills=[(s, s.num_uncomputed_tokens) for s in seqs if s is not None], checkpoints=checkpoints)

    def with_checkpoints(self, batch: ScheduledBatch) -> None:
        """Prefix caching's in-launch checkpoints (the kernels' variants that write them): every
        32 tokens of each prefill into the checkpoint slots (nothing is cached yet, so nothing
        reads what lands there), as wide as the engine stages them."""
        first, count = self.memory.num_running_slots, self.memory.num_checkpoint_slots
        backends = self.runner.kda_backends
        if not count or backends is None or not backends.takes_checkpoints_in_step:
            return
        cap = self.runner.config.prefix_cache_states_per_request
        batch.checkpoints = [[(o, first + (j % count)) for j, o in enumerate(range(32, n, 32)[:cap])]
                             for n in batch.num_new_tokens]
        batch.checkpoint_width = checkpoint_table_width(cap)

    def run(self) -> None:
        B, L = self.budget, self.max_model_len - 1
        for n in (1, 16, 32, 64, 37):                 # one sequence: T == 1, T % 16 == 0, odd T
            self.prefill(self.new(n))
            self.release()
        # Three at once, each sampling its own way (the sampler's staged paths, log-probs).
        trio = [
            self.new(5, SamplingParams(max_tokens=1 << 30, ignore_eos=True, logprobs=2, prompt_logprobs=1)),
            self.new(17, SamplingParams(max_tokens=1 << 30, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9)),
            self.new(40, SamplingParams(max_tokens=1 << 30, ignore_eos=True, temperature=1.0, seed=0)),
        ]
        self.prefill(*trio)
        self.step(decodes=trio)                       # pure decode of 3
        chunked = self.new(40)
        self.step(decodes=trio, prefills=[(chunked, 24)])   # mixed, a prompt's first chunk
        self.step(decodes=trio, prefills=[(chunked, 16)])   # mixed, its continuation (initial state)
        self.step(decodes=trio[:1], prefills=[(self.new(3), 3)])   # mixed with 1 decode
        self.step(decodes=trio[:1])                   # pure decode of 1
        self.release()
        # Decode batches change kernel shape at a few sizes of sequences x heads (the fused rule:
        # one-warp split shapes, then [32, K] ones for a bf16 state, then the stream shape from
        # 256 heads), so start small enough that every class is reached for 16-64 heads: p - 1,
        # p, p + 1 for p = 4, 8, 16, ...
        p = 4
        while True:
            self.batch_sizes(p)
            if p >= self.max_seqs:
                break
            p *= 2
        for checkpoints in (False, True):   # with prefix caching's in-launch checkpoints too
            self.prefill(self.new(min(B, L)), checkpoints=checkpoints)   # the whole budget: long-sequence plans
            self.release()
            k = max(1, min(8, self.max_seqs))
            self.prefill(*[self.new(min(L, max(B // k, 1))) for _ in range(k)], checkpoints=checkpoints)
            self.release()

    def batch_sizes(self, p: int) -> None:
        """Batches around p (a power of two >= 4): wrappers derive launch constants from the
        number of sequences (block sizes of next_pow2(N), one kernel shape up to some N * heads
        and another above), and N itself is specialized (1, % 16, else), so each size class of
        prefill and decode batches needs its own variants: p - 1, p and p + 1 sequences."""
        odd = [self.new(1 + k % 2) for k in range(p - 1)]
        self.prefill(*odd)                            # p - 1 prompts of 1 and 2 tokens
        self.step(decodes=odd, prefills=[(self.new(37), 37)])   # mixed, p - 1 decodes
        self.step(decodes=odd)                        # pure decode of p - 1
        self.release()
        even = [self.new(1) for _ in range(p)]
        self.prefill(*even)                           # p one-token prompts
        self.step(decodes=even, prefills=[(self.new(21), 21)])  # mixed, p decodes
        self.step(decodes=even)                       # pure decode of p
        more = even + [self.new(1)]
        self.prefill(more[-1])
        self.step(decodes=more, prefills=[(self.new(5), 5)])    # mixed, p + 1 decodes
        self.release()


def warm_up(runner: ModelRunner, slots: StateSlotPool, blocks: BlockManager, memory: MemoryPlan, *, vocab_size: int,
            tokenizer) -> int:
    """Run the warm-up steps; returns how many ran. Pools must be empty before and are after."""
    if slots.num_used or blocks.num_used:
        raise RuntimeError(f"warm-up needs empty pools (it runs before any request); {slots.num_used} state slot(s) "
                           f"and {blocks.num_used} KV block(s) are in use: finish or abort the requests first")
    t0 = time.perf_counter()
    generator = runner.sampler.generator
    rng_state = generator.get_state()
    w = Warmup(runner, slots, blocks, memory, vocab_size=vocab_size, tokenizer=tokenizer)
    try:
        with warm_up_compiles():   # each launcher's kernels compile in parallel (ops/compile_ahead.py)
            w.run()
    finally:
        w.release()
        generator.set_state(rng_state)
    slots.reset()
    blocks.reset()
    if runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    log.info("warm-up: %d steps in %.2f s (kernel specializations compiled before the first request)",
             w.steps, time.perf_counter() - t0)
    return w.steps
