"""A request as the engine tracks it: its tokens, how many of them the caches hold, where its
state lives (one state slot for all KDA layers, KV blocks for the full-attention layers)."""

from __future__ import annotations

import enum
import itertools
import time

import numpy as np

from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.multimodal import ImageItem
from kdaserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, detokenizer: IncrementalDetokenizer,
                 images: tuple[ImageItem, ...] = ()):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.params = params
        # The prompt's images (engine/multimodal.py), placed at their placeholder tokens, in order.
        self.images = images
        # token_ids, logprobs and prompt_logprobs only ever grow by append: outputs are O(1)
        # snapshots of them (outputs.ListPrefix), which any other change would corrupt.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self._prompt = list(prompt_token_ids)   # shared by every output of this request: no copy per step
        self.status = SequenceStatus.WAITING
        # Tokens whose effect the caches hold (KV rows written, recurrent state advanced past them).
        self.num_computed_tokens = 0
        self.state_slot = 0                 # 0 = none (the null slot)
        # Speculative decoding (engine/speculative): S more state slots, so that a verify step can
        # keep the state after each of its S+1 tokens; the step resumes from
        # verify_slots[num_accepted - 1], where verify_slots = spec_slots + [state_slot].
        # num_accepted = S+1 after a prefill (the state is in state_slot, the conv window newest).
        self.spec_slots: list[int] = []
        self.num_accepted = 1
        self.draft_token_ids: list[int] = []   # the drafts of the next verify step
        # Verify steps with drafts, by drafts accepted (index j: steps that accepted j), and drafts
        # proposed: the request's own acceptance, reported in its finished output.
        self.spec_histogram: list[int] | None = None
        self.num_draft_tokens = 0
        # Grows by append only; BlockManager.free replaces it with a new list (block_table_array's
        # cache relies on both).
        self.block_table: list[int] = []
        self._block_array: tuple[list[int], np.ndarray] | None = None
        # Prefix caching (engine/prefix_cache): the chained hashes of its full blocks, how many
        # of its blocks are registered, the checkpoints it took, and the prompt tokens it found
        # cached when admitted (usage's cached_tokens).
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.checkpoint_keys: list[tuple[int, bytes]] = []   # (token position, block hash)
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.generator = None               # per-request torch.Generator when params.seed is set
        self.grammar = None                 # xgrammar matcher of params.structured_outputs (engine sets it)
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict | None] | None = [None] if params.prompt_logprobs is not None else None
        self.new_token_ids: list[int] = []  # appended since the request's last output
        # Tokens per output (the engine's --stream-interval, raised by the request's) and whether
        # an output with tokens went out yet (the first token's is never held back).
        self.stream_interval = params.stream_interval or 1
        self.streamed = False
        self.metrics = {"arrival_time": time.monotonic()}   # times are only ever added to it
        # What sampling needs, read per step (the params do not change once a request is added):
        # anything that changes the logits (processors, a grammar), and the plain greedy argmax.
        self.logits_processed = params.has_logits_processors or params.structured_outputs is not None
        self.plain_greedy = params.greedy and params.logprobs is None and not self.logits_processed
        self.metrics_out: tuple | None = None   # OutputProcessor._metrics: (what it was made from, the outputs' dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def block_table_array(self) -> np.ndarray:
        """The block table as int32 numpy, rebuilt only when it changed (every block_size tokens):
        a decode step copies 64 of these rows, converting Python lists each time cost ~1 us a row."""
        cached = self._block_array
        table = self.block_table
        if cached is None or cached[0] is not table or cached[1].shape[0] != len(table):
            cached = self._block_array = (table, np.asarray(table, dtype=np.int32))
        return cached[1]

    @property
    def verify_slots(self) -> list[int]:
        return self.spec_slots + [self.state_slot]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, value: SequenceStatus) -> None:
        self._status = value
        # A plain attribute, not a property: read several times per request and step.
        self.is_finished = value is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
