"""Runs one scheduled step on the model: host metadata -> device, forward (eager, or a CUDA-graph
replay for pure decode steps), logits for the rows that need them, sampling and log-probs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kdaserve.engine.caches import StepCaches, format_bytes, kv_bytes_per_block, state_bytes_per_slot
from kdaserve.engine.config import EngineConfig
from kdaserve.engine.cuda_graphs import DecodeGraphs
from kdaserve.engine.sampler import PendingSample, Sampler, SampleResult, logprob_rows
from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.speculative.rejection_sampler import AcceptedTokens, RejectionSampler
from kdaserve.engine.staging import StagingRing
from kdaserve.engine.step_inputs import build_host_step, gather_inputs, to_device_context
from kdaserve.layers.attention import AttentionMetadata
from kdaserve.layers.context import Context, reset_context, set_context
from kdaserve.models.loader import load_model

log = logging.getLogger("kdaserve.engine")

_CPU_KV_BYTES = 1 << 30   # default KV-cache budget on the CPU
# Decode batches up to this size are captured by default (each size is a graph captured at startup;
# larger batches run eagerly, where launch overhead matters less).
_DEFAULT_MAX_GRAPH_BATCH = 512


@dataclass
class StepResult:
    # token_ids / logprobs per sampling sequence; a PendingSample also has them on the device
    sampled: SampleResult | PendingSample
    sample_seqs: list[Sequence]
    # (sequence, prompt token index, {"token_id", "logprob", "top"}) in prompt order
    prompt_logprobs: list[tuple[Sequence, int, dict]]
    # With speculative decoding: per sampling sequence, the tokens it accepted (sampled is empty)
    accepted: list[AcceptedTokens] | None = None
    # Speculative method "mtp": each sampling sequence's drafts for its next verify
    drafts: list[tuple[Sequence, list[int]]] = field(default_factory=list)


def capacity_error(*, max_num_seqs: int, num_spec_tokens: int, per_slot: int, state: int, one_seq: int, per_block: int,
                   block_size: int, max_model_len: int, free: int, gpu_memory_utilization: float,
                   num_checkpoint_slots: int = 0) -> str:
    """What does not fit (the KDA state of every sequence's slots and of the prefix cache's
    checkpoint slots, and the attention cache of one full sequence, in `free` bytes), how many
    sequences would beside those checkpoints, and what to change."""
    gib = 2**30
    per_seq = num_spec_tokens + 1   # state slots per sequence (S+1 with speculative decoding)
    fit = max(0, ((free - one_seq) // per_slot - 1 - num_checkpoint_slots) // per_seq) if per_slot else 0
    tokens = max(0, (free - state) // per_block - 1) * block_size
    shorter = f" or --max-model-len to at most {tokens}" if tokens > 0 else ""
    spec = f", {per_seq} slots per sequence with num_speculative_tokens={num_spec_tokens}" if per_seq > 1 else ""
    checkpoints = (f" with {num_checkpoint_slots} prefix-cache checkpoint slots (--prefix-cache-states)"
                   if num_checkpoint_slots else "")
    return (f"max_num_seqs={max_num_seqs} needs {state / gib:.2f} GiB of KDA state ({format_bytes(per_slot)} per "
            f"state slot{spec}){checkpoints} plus {format_bytes(one_seq)} of attention cache for one sequence of max_model_len="
            f"{max_model_len}, but {max(free, 0) / gib:.2f} GiB are left after the weights and activations at "
            f"gpu_memory_utilization={gpu_memory_utilization}: {fit} sequences fit; lower --max-num-seqs to at "
            f"most {fit}{shorter}, or raise --gpu-memory-utilization")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        spec = config.speculative_config
        self.mtp = spec is not None and spec.method == "mtp"   # the model's MTP layer drafts (_mtp_drafts)
        loaded = load_model(config.model, dtype=config.dtype, device=self.device, kda=config.kda, seed=config.seed,
                            load_format=config.load_format, mla_backend=config.mla_backend, moe_backend=config.moe_backend,
                            tokenizer_dir=config.tokenizer, mtp=self.mtp, quantization=config.quantization)
        self.model = loaded.model.eval()
        self.tokenizer, self.model_config, self.model_name = loaded.tokenizer, loaded.config, loaded.name
        self.kda_backends = self.model.kda_backends  # resolved once, by the model
        self.block_size = config.block_size
        context = self.model_config.max_position_embeddings
        self.max_model_len = context if config.max_model_len is None else min(config.max_model_len, context)
        if config.max_model_len is not None and self.max_model_len < config.max_model_len:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings; using %d",
                        config.max_model_len, self.max_model_len)
        self.blocks_per_seq = -(-self.max_model_len // self.block_size)
        # One state slot per sequence, S+1 with speculative decoding (engine/speculative), + the null slot.
        self.num_spec_tokens = config.num_spec_tokens
        # Then the prefix cache's KDA checkpoints (engine/prefix_cache), slots apart from the running ones.
        self.num_running_slots = config.max_num_seqs * (self.num_spec_tokens + 1) + 1
        self.num_checkpoint_slots = config.prefix_cache_states if config.enable_prefix_caching else 0
        self.num_slots = self.num_running_slots + self.num_checkpoint_slots
        self.num_kv_blocks = self._decide_num_kv_blocks()
        self.caches = StepCaches(self.model, self.num_slots, self.num_kv_blocks, self.block_size, config.dtype, self.device)
        self.sampler = Sampler(self.device, config.seed)
        self.rejection_sampler = RejectionSampler(self.device, self.sampler.generator) if self.num_spec_tokens else None
        self.step_ring = StagingRing(64 << 10, self.device)   # eager steps' metadata; grows to the largest step
        self.graphs = None
        not_capturable = self.kda_backends is not None and not self.kda_backends.decode.graph_capturable
        if config.use_cuda_graphs and not_capturable:
            log.warning("CUDA graphs off: KDA decode backend %s cannot be captured", self.kda_backends.decode.name)
        elif config.use_cuda_graphs:
            self.graphs = DecodeGraphs(
                self.model, max_batch_size=config.cuda_graph_max_batch_size or min(config.max_num_seqs, _DEFAULT_MAX_GRAPH_BATCH),
                block_table_width=self.blocks_per_seq, trash_row=self.caches.trash_row,
                hidden_size=self.model_config.hidden_size, dtype=config.dtype, device=self.device,
                tokens_per_seq=self.num_spec_tokens + 1,
            )

    # -- memory -------------------------------------------------------------------------------

    def _decide_num_kv_blocks(self) -> int:
        """Blocks for the KV pool (null block included): what the user asked, else what fits in
        memory, capped at what max_num_seqs sequences of max_model_len can use."""
        cfg = self.config
        enough = cfg.max_num_seqs * self.blocks_per_seq + 1
        if cfg.num_kv_blocks is not None:
            if cfg.num_kv_blocks < self.blocks_per_seq + 1:
                raise ValueError(
                    f"num_kv_blocks={cfg.num_kv_blocks} cannot hold one sequence of max_model_len={self.max_model_len} "
                    f"({self.blocks_per_seq} blocks of {self.block_size} + the null block); expected >= {self.blocks_per_seq + 1}"
                )
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.model, self.block_size, cfg.dtype)
        if per_block == 0:   # no full-attention layers: blocks are bookkeeping only
            return enough
        if self.device.type != "cuda":
            return max(self.blocks_per_seq + 1, min(enough, _CPU_KV_BYTES // per_block))
        free = self._free_gpu_bytes()
        per_slot = state_bytes_per_slot(self.model)
        one_seq = (self.blocks_per_seq + 1) * per_block
        state = self.num_slots * per_slot
        gib = 2**30
        if state + one_seq > free:
            raise RuntimeError(capacity_error(
                max_num_seqs=cfg.max_num_seqs, num_spec_tokens=self.num_spec_tokens, per_slot=per_slot, state=state,
                one_seq=one_seq, per_block=per_block, block_size=self.block_size, max_model_len=self.max_model_len,
                free=free, gpu_memory_utilization=cfg.gpu_memory_utilization,
                num_checkpoint_slots=self.num_checkpoint_slots))
        blocks = int(min(enough, (free - state) // per_block))
        self.memory_plan = {"state_gib": state / gib, "kv_gib": blocks * per_block / gib, "kv_tokens": blocks * self.block_size,
                            "free_gib": free / gib}
        log.info("memory: KDA state %.2f GiB (%d slots), attention cache %.2f GiB (%d blocks, %d tokens), of %.2f GiB "
                 "left for caches", state / gib, self.num_slots, blocks * per_block / gib, blocks, blocks * self.block_size,
                 free / gib)
        return blocks

    @torch.inference_mode()
    def _free_gpu_bytes(self) -> int:
        """GPU bytes the caches may take: the utilization target minus what is in use and the
        peak of a dummy forward of a full token budget (activations)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        T = min(self.config.max_num_batched_tokens, self.max_model_len)
        set_context(Context())   # no metadata: KDA layers touch no state
        ids = torch.zeros(T, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, torch.arange(T, device=self.device))
        if self.mtp:   # the drafter's pass over the same rows
            self.model.draft_hidden(ids, torch.arange(T, device=self.device), hidden)
        # A step samples at most max_num_seqs rows, (S+1) times that with speculative decoding.
        self.model.compute_logits(hidden[: self.config.max_num_seqs * (self.num_spec_tokens + 1)])
        reset_context()
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # The KDA prefill kernels' workspaces are not all exercised by a no-metadata run: keep a margin.
        margin = 2 * activations + (1 << 30)
        return int(free - (1 - self.config.gpu_memory_utilization) * total - margin)

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole state slots (every KDA layer's conv window and recurrent state), src -> dst,
        in stream order: prefix-cache checkpoints and their restores."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64).to(self.device, non_blocking=True)
        for conv, rec in self.caches.kda:
            conv.index_copy_(0, dst, conv.index_select(0, src))
            rec.index_copy_(0, dst, rec.index_select(0, src))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, input_source: torch.Tensor | None = None) -> StepResult:
        """Queue the step on the device; nothing waits for it (the sampled tokens arrive through
        StepResult.sampled, a PendingSample). `input_source`: with batch.input_rows (async
        scheduling), the step before's sampled tokens on the device, which the decodes read."""
        if (batch.input_rows is None) != (input_source is None):
            raise ValueError("a step with input_rows needs the device tokens they index (input_source), and only it")
        self.copy_states(batch.restores)   # prefix-cache hits: their states before the step reads them
        width = self.blocks_per_seq if self.graphs is not None and not batch.prefills else None
        step = build_host_step(batch, self.block_size, decode_width=width, trash_row=self.caches.trash_row)
        if self.graphs is not None and self.graphs.can_run(step):
            hidden, sample_rows = self.graphs.run(step, input_source)
            # The MTP drafter runs eagerly after the replay, under the replayed step's metadata.
            context, positions = self.graphs.attention_context(step) if self.mtp else (None, None)
        else:
            dev = to_device_context(step, self.device, self.step_ring)
            if input_source is not None:
                gather_inputs(dev.input_ids[: step.num_decodes], input_source)
            sample_rows = dev.sample_rows
            if self.kda_backends is not None:  # once per step, for every KDA layer
                dev.context.kda_plan = self.kda_backends.plan_step(dev.context.kda)
            set_context(dev.context)
            try:
                hidden = self.model(dev.input_ids, dev.positions)
            finally:
                reset_context()
            context, positions = dev.context, dev.positions
        want = step.logits
        sampled = SampleResult([], [])
        accepted = [] if want.groups is not None else None
        if want.sample_rows:
            # The rows' index was staged with the step's metadata; None: rows 0..k-1, a slice.
            rows = hidden[: len(want.sample_rows)] if sample_rows is None else hidden[sample_rows]
            logits = self.model.compute_logits(rows)
            if want.groups is not None:
                accepted = self.rejection_sampler.sample(logits, want.groups)
            else:
                sampled = self.sampler.sample(logits, want.sample_seqs)
        drafts = self._mtp_drafts(batch, step, context, positions, hidden, accepted) if self.mtp else []
        return StepResult(sampled, want.sample_seqs, self._prompt_logprobs(hidden, want.prompt_rows), accepted, drafts)

    def _mtp_drafts(self, batch: ScheduledBatch, step, context: Context, positions: torch.Tensor, hidden: torch.Tensor,
                    accepted: list[AcceptedTokens]) -> list[tuple[Sequence, list[int]]]:
        """The MTP layer over every row of the step (models/glm5_next_mtp.py): row i reads the
        target's hidden state and the token after its own (the next prompt token, or the token
        the step accepted there; padding and rejected rows read 0: their cache rows are
        rewritten before anyone reads them), under the step's attention metadata, so the layer's
        caches hold every computed position. A sampling sequence's first draft is the greedy
        token at the row of its newest token; each further draft is one more pass of the layer
        over one row per sequence (_mtp_draft_pass). One host read for all the drafts (the step's
        tokens were read already)."""
        m = step.tokens_per_decode
        by_seq = {a.seq.seq_id: a for a in accepted}
        next_ids = torch.zeros(hidden.shape[0], dtype=torch.int64)
        sources: list[tuple[Sequence, int, int]] = []   # (sequence, row, position of the row)
        for i, seq in enumerate(batch.decodes):
            toks = by_seq[seq.seq_id].tokens
            next_ids[i * m : i * m + len(toks)] = torch.tensor(toks)
            sources.append((seq, i * m + len(toks) - 1, seq.num_computed_tokens + len(toks) - 1))
        row = len(batch.decodes) * m
        for seq, n in zip(batch.prefills, batch.num_new_tokens):
            p = seq.num_computed_tokens
            known = seq.token_ids[p + 1 : p + n + 1]   # the prompt tokens after each row
            next_ids[row : row + len(known)] = torch.tensor(known, dtype=torch.int64)
            if len(known) < n:   # the last row of a finished prompt: the token the step sampled
                next_ids[row + n - 1] = by_seq[seq.seq_id].tokens[0]
                sources.append((seq, row + n - 1, p + n - 1))
            row += n
        set_context(context)   # every step: a prompt chunk that samples nothing still fills the caches
        try:
            out = self.model.draft_hidden(next_ids.to(self.device, non_blocking=True), positions, hidden)
        finally:
            reset_context()
        if not sources:
            return []
        rows = torch.tensor([r for _, r, _ in sources], dtype=torch.int64).to(self.device, non_blocking=True)
        h = out[rows]
        # Drafts stay on the device until the end: each pass reads the previous pass's tokens there,
        # and one host read returns them all.
        drafts = torch.zeros(len(sources), self.num_spec_tokens, dtype=torch.int64, device=self.device)
        drafts[:, 0] = self.model.compute_logits(h).argmax(-1)
        counts = [1] * len(sources)
        live = list(range(len(sources)))   # the sources `h` holds a row of, in order
        for j in range(1, self.num_spec_tokens):
            # Draft j+1 reads draft j at the position after the previous pass's, and that pass's
            # output as its hidden state (vLLM's recycling of the MTP output). Positions past the
            # cache rows a sequence holds (its max_model_len) end its drafts.
            keep = [k for k, i in enumerate(live) if sources[i][2] + j < len(sources[i][0].block_table) * self.block_size]
            if not keep:
                break
            if len(keep) < len(live):
                h = h[torch.tensor(keep, device=h.device)]
                live = [live[k] for k in keep]
            index = torch.tensor(live, device=self.device)
            h = self._mtp_draft_pass([sources[i][0] for i in live], [sources[i][2] + j for i in live],
                                     drafts[index, j - 1], h)
            drafts[index, j] = self.model.compute_logits(h).argmax(-1)
            for i in live:
                counts[i] += 1
        return [(seq, d[:n]) for (seq, _, _), d, n in zip(sources, drafts.tolist(), counts)]

    def _mtp_draft_pass(self, seqs: list[Sequence], positions: list[int], tokens: torch.Tensor,
                        hidden: torch.Tensor) -> torch.Tensor:
        """One more MTP step: per sequence one row at `positions[i]` (a cache row the scheduler
        reserved: EngineConfig's MTP lookahead) reading `tokens[i]` (on the device) and `hidden[i]`, attending
        over the layer's cache up to and including that row, as a decode step does."""
        bs = self.block_size
        width = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        slots = [s.block_table[q // bs] * bs + q % bs for s, q in zip(seqs, positions)]
        to = dict(device=self.device, non_blocking=True)
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64).to(**to), num_decode_tokens=len(seqs),
                               decode_block_tables=tables.to(**to),
                               decode_context_lens=torch.tensor([q + 1 for q in positions], dtype=torch.int32).to(**to))
        set_context(Context(attn=md))
        try:
            return self.model.draft_hidden(tokens, torch.tensor(positions, dtype=torch.int64).to(**to), hidden)
        finally:
            reset_context()

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list) -> list:
        """Scored max_num_seqs rows at a time: [rows, vocab] fp32 logits of a whole scored prompt
        chunk (lm-eval's echo + logprobs) would be gigabytes the memory profile never reserved."""
        out = []
        per_call = self.config.max_num_seqs
        for i in range(0, len(prompt_rows), per_call):
            part = prompt_rows[i : i + per_call]
            logits = self.model.compute_logits(hidden[torch.tensor([r for _, r, _ in part], device=self.device, dtype=torch.int64)])
            targets = torch.tensor([s.token_ids[t] for s, _, t in part], device=self.device)
            res = logprob_rows(logits, targets, [s.params.prompt_logprobs for s, _, _ in part])
            for (seq, _, t), (lp, top) in zip(part, res):
                out.append((seq, t, {"token_id": seq.token_ids[t], "logprob": lp, "top": top}))
        return out
