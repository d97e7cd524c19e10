"""The prefix cache's decisions: what a newly admitted request can skip, where a prefill chunk
ends so that a checkpoint can be taken, and what a step leaves cached (package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.engine.block_manager import BlockManager
from kdaserve.engine.prefix_cache.checkpoints import StateCheckpoints
from kdaserve.engine.prefix_cache.hashing import BlockHasher
from kdaserve.engine.sequence import Sequence


@dataclass
class PrefixHit:
    num_tokens: int           # prompt tokens restored (a multiple of the checkpoint interval)
    blocks: list[int]         # the cached KV blocks before them
    checkpoint: int           # the state slot holding the KDA state after them


# Interior checkpoints sit this many tokens apart from a chunk's start (a multiple of every
# prefill chunk a backend uses: flash's 16 and 32); other boundaries cut the chunk.
CHECKPOINT_ALIGN = 32


class PrefixCache:
    def __init__(self, blocks: BlockManager, checkpoints: StateCheckpoints, hasher: BlockHasher, interval: int,
                 per_request: int, speculative: bool, in_step: bool = False):
        """`in_step`: the prefill backend writes checkpoints inside its launch (CheckpointRequests),
        so a chunk is cut only at boundaries it cannot take that way."""
        self.blocks, self.checkpoints, self.hasher = blocks, checkpoints, hasher
        self.interval, self.per_request, self.speculative = interval, per_request, speculative
        self.in_step = in_step
        self.block_size = hasher.block_size
        self.queries = 0   # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0      # of them, found cached (prefix_cache_hits)

    enabled = True

    def begin_step(self) -> None:
        """A new step: the restores of the step before are done, their checkpoints evictable again."""
        self.checkpoints.pinned.clear()

    def stats(self) -> dict:
        """vLLM's prefix-cache counters and the pools' cached entries (LLMEngine.stats)."""
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_blocks": self.blocks.num_cached, "prefix_cache_states": self.checkpoints.num_cached,
                "prefix_cache_states_total": self.checkpoints.capacity}

    def hashes(self, seq: Sequence) -> list[bytes]:
        return self.hasher.extend(seq.block_hashes, seq.token_ids, seq.params.cache_salt, seq.images)

    def find(self, seq: Sequence) -> PrefixHit | None:
        """The longest cached prefix of `seq` that ends on a checkpoint, leaving at least one token
        to compute (its logits give the next token). Requests that want prompt log-probs compute
        every prompt token."""
        if seq.params.prompt_logprobs is not None:
            return None
        hashes = self.hashes(seq)
        # With speculation the rest must be 2+ tokens: one token with history would be a verify.
        usable = (seq.num_tokens - (2 if self.speculative else 1)) // self.block_size
        blocks = self.blocks.cached_prefix(hashes[:usable])
        n = len(blocks) * self.block_size // self.interval * self.interval
        while n > 0:
            slot = self.checkpoints.lookup(hashes[n // self.block_size - 1])
            if slot is not None:
                return PrefixHit(n, blocks[: n // self.block_size], slot)
            n -= self.interval
        return None

    def should_wait(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether `seq` should wait for a running request that is prefilling the same prefix (the
        n samples of one request, a burst of requests with one system prompt): once that request
        passes the last checkpoint boundary they share, `seq` resumes from it instead of
        computing the prefix again at the same time."""
        if seq.params.prompt_logprobs is not None:
            return False
        mine = self.hashes(seq)
        per_interval = self.interval // self.block_size
        limit = (seq.num_tokens - (2 if self.speculative else 1)) // self.interval * per_interval
        if limit == 0:
            return False
        for other in running:
            if other.num_computed_tokens >= other.num_prompt_tokens or other.params.cache_salt != seq.params.cache_salt:
                continue   # not prefilling its prompt (or a different salt: nothing to share)
            theirs = self.hashes(other)
            shared = 0
            while shared < min(limit, len(theirs)) and theirs[shared] == mine[shared]:
                shared += 1
            boundary = shared // per_interval * self.interval
            if boundary and other.num_computed_tokens < boundary:
                return True
        return False

    def count_query(self, seq: Sequence, hit: PrefixHit | None) -> None:
        if seq.params.prompt_logprobs is None:
            self.queries += seq.num_tokens
            self.hits += hit.num_tokens if hit else 0

    def apply(self, seq: Sequence, hit: PrefixHit) -> tuple[int, int]:
        """Share the hit's blocks with `seq` (which holds none yet) and skip its tokens; returns the
        (checkpoint, own slot) copy the step must run before its forward pass."""
        self.blocks.share(seq, hit.blocks)
        self.checkpoints.pinned.add(hit.checkpoint)
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_tokens = max(seq.num_cached_tokens, hit.num_tokens)
        return hit.checkpoint, seq.state_slot

    def chunk_len(self, seq: Sequence, n: int) -> int:
        """A prefill chunk of `n` tokens from seq.num_computed_tokens, cut at a checkpoint boundary
        it crosses (the state there is then the chunk's final state): the last one, or with
        in-step checkpoints the first one the backend cannot take (not CHECKPOINT_ALIGN tokens
        from the start). A 1-token chunk with history is never made with speculation (it would be
        a verify)."""
        start = seq.num_computed_tokens
        if self.in_step:
            cut = next((b for b in self._interior(start, n) if (b - start) % CHECKPOINT_ALIGN), None)
        else:
            cut = (start + n) // self.interval * self.interval
        if cut is not None and start < cut < start + n and not (self.speculative and cut - start == 1 and start > 0):
            return cut - start
        return n

    def _interior(self, start: int, n: int) -> range:
        """Checkpoint boundaries strictly inside a chunk of n tokens from `start`."""
        return range((start // self.interval + 1) * self.interval, start + n, self.interval)

    def step_checkpoints(self, seq: Sequence, n: int) -> list[tuple[int, int]]:
        """The (offset into the chunk, checkpoint slot) pairs the prefill of this chunk writes
        inside its launch (in_step backends): every interior boundary, each a slot taken now and
        hidden from lookups until after_step (the forward fills it)."""
        if not self.in_step:
            return []
        start = seq.num_computed_tokens
        hashes = None
        pairs = []
        for b in self._interior(start, n):
            if (b - start) % CHECKPOINT_ALIGN:
                break   # chunk_len cut the chunk before any such boundary
            hashes = hashes if hashes is not None else self.hashes(seq)
            key = hashes[b // self.block_size - 1]
            slot = self.checkpoints.take(key, pending=True)
            if slot is None:
                continue
            pairs.append((b - start, slot))
            seq.checkpoint_keys.append((b, key))
            if len(seq.checkpoint_keys) > self.per_request:
                dropped = self._drop_one(seq, untake=True)
                pairs = [p for p in pairs if p[0] != dropped - start]   # not written after all
        return pairs

    def after_step(self, batch) -> list[tuple[int, int]]:
        """Register the full blocks the step completed and checkpoint the states that reached a
        boundary; returns the (own slot, checkpoint) copies to run after the step's forward."""
        self.checkpoints.pending.clear()   # the forward pass has written them
        copies = []
        decodes = set(id(s) for s in batch.decodes) if self.speculative else ()
        for seq in batch.sequences:
            done = seq.num_computed_tokens
            if not seq.state_slot:   # finished or preempted within the step
                continue
            full = min(done // self.block_size, len(seq.block_table))
            checkpoint = done and not done % self.interval and id(seq) not in decodes
            if full <= seq.num_registered_blocks and not checkpoint:
                continue   # most decode steps: no block filled, no boundary (hashes extend when needed)
            hashes = self.hashes(seq)
            self.blocks.register(seq, hashes, full)
            if not checkpoint:
                continue
            key = hashes[done // self.block_size - 1]
            slot = self.checkpoints.take(key)
            if slot is None:
                continue
            copies.append((seq.state_slot, slot))
            seq.checkpoint_keys.append((done, key))
            if len(seq.checkpoint_keys) > self.per_request:
                self._drop_one(seq)
        return copies

    def _drop_one(self, seq: Sequence, untake: bool = False) -> int:
        """Past its cap a request keeps the checkpoint at the end of its prompt's last interval
        (what other requests with the same prompt start can share: a system prompt) and its
        newest (where its next turn resumes); of the others, the oldest goes. Returns its
        position. `untake`: it may be one this step's prefill was to write (step_checkpoints)."""
        keys = seq.checkpoint_keys
        in_prompt = [i for i, (pos, _) in enumerate(keys) if pos <= seq.num_prompt_tokens]
        keep = {len(keys) - 1, in_prompt[-1] if in_prompt else -1}
        victim = next((i for i in range(len(keys)) if i not in keep), 0)   # a cap of 1 keeps the newest only
        pos, key = keys.pop(victim)
        self.checkpoints.drop(key, untake=untake)
        return pos

    def clear(self) -> None:
        """Forget everything cached that no running request holds (tests, benchmarks)."""
        self.blocks.clear_cache()
        self.checkpoints.clear()
