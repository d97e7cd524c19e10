"""Runs one scheduled step on the model: host metadata -> device, forward (eager, or a CUDA-graph
replay for pure decode steps), logits for the rows that need them, sampling and log-probs. It is
given the loaded model and the memory plan (engine/memory.py) and builds the caches, the sampler
and the graphs; it sizes nothing and loads nothing itself."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from kdaserve.engine.caches import StepCaches
from kdaserve.engine.config import EngineConfig
from kdaserve.engine.cuda_graphs import DecodeGraphs
from kdaserve.engine.encoder_cache import EncoderCache, EncoderPlanner, encoder_call_tokens
from kdaserve.engine.memory import MemoryPlan
from kdaserve.engine.sampler import PendingSample, Sampler, SampleResult, logprob_rows
from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.speculative.mtp_drafter import MtpDrafter
from kdaserve.engine.speculative.rejection_sampler import AcceptedTokens, RejectionSampler
from kdaserve.engine.staging import StagingRing
from kdaserve.engine.step_inputs import HostStep, LogitsRequest, build_host_step, gather_inputs, to_device_step
from kdaserve.layers.context import reset_context, set_context
from kdaserve.models.loader import LoadedModel, load_model

log = logging.getLogger("kdaserve.engine")

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


def load_engine_model(config: EngineConfig) -> LoadedModel:
    """The model an engine of `config` serves, its KDA backends resolved once (by the loader)."""
    spec = config.speculative_config
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, kda=config.kda, seed=config.seed,
                        load_format=config.load_format, mla_backend=config.mla_backend, moe_backend=config.moe_backend,
                        tokenizer_dir=config.tokenizer, mtp=spec is not None and spec.method == "mtp",
                        quantization=config.quantization, images=config.max_images_per_prompt > 0)
    loaded.model.eval()   # before the memory plan's profiled forward
    return loaded


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, memory: MemoryPlan, ranks=None):
        """`ranks`: rank 0's TensorParallelRanks (engine/tensor_parallel.py), told every step and
        state copy before this rank runs it; None on one rank and on the other ranks."""
        self.config, self.memory, self.ranks = config, memory, ranks
        self.device = config.device
        self.model = loaded.model
        self.kda_backends = loaded.kda_backends   # the loader's pair, the one every KDA layer holds
        self.block_size = config.block_size
        self.num_spec_tokens = config.num_spec_tokens
        self.caches = StepCaches(self.model, memory.num_slots, memory.num_kv_blocks, self.block_size, config.dtype,
                                 self.device)
        self.sampler = Sampler(self.device, config.seed)
        self.rejection_sampler = RejectionSampler(self.device, self.sampler.generator) if self.num_spec_tokens else None
        spec = config.speculative_config
        self.step_ring = StagingRing(64 << 10, self.device)   # eager steps' metadata; grows to the largest step
        # Image embeddings (models with a vision tower): planned on rank 0, kept alike on every rank.
        images = getattr(self.model, "image_token_id", None) is not None
        self.encoder_planner = EncoderPlanner(config.max_num_batched_tokens) if images else None
        self.encoder_cache = EncoderCache(self.model, self.device, encoder_call_tokens(config, self.model)) if images else None
        self.drafter = (MtpDrafter(self.model, num_spec_tokens=self.num_spec_tokens, block_size=self.block_size,
                                   device=self.device, encoder_cache=self.encoder_cache)
                        if spec is not None and spec.method == "mtp" else None)
        self.graphs = None
        not_capturable = self.kda_backends is not None and not self.kda_backends.decode.graph_capturable
        if config.use_cuda_graphs and not_capturable:
            log.warning("CUDA graphs off: KDA decode backend %s cannot be captured", self.kda_backends.decode.name)
        elif config.use_cuda_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kda_backends,
                max_batch_size=config.cuda_graph_max_batch_size or min(config.max_num_seqs, _DEFAULT_MAX_GRAPH_BATCH),
                block_table_width=memory.blocks_per_seq, trash_row=self.caches.trash_row,
                hidden_size=loaded.config.hidden_size, dtype=config.dtype, device=self.device,
                tokens_per_seq=self.num_spec_tokens + 1,
            )

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole state slots (every KDA layer's conv window and recurrent state), src -> dst,
        in stream order: prefix-cache checkpoints and their restores."""
        if not pairs:
            return
        if self.ranks is not None:
            self.ranks.send(("copy", pairs))
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
        width = self.memory.blocks_per_seq if self.graphs is not None and not batch.prefills else None
        step = build_host_step(batch, self.block_size, decode_width=width, trash_row=self.caches.trash_row)
        if self.encoder_planner is not None:
            step.images = self.encoder_planner.plan(batch, batch.tokens_per_decode)
        if self.ranks is not None:   # the other ranks run the same forward, and the LM head on the sample rows
            self.ranks.send(("step", dataclasses.replace(step, logits=LogitsRequest()),
                             None if input_source is None else input_source.shape[0], list(step.logits.sample_rows)))
            if input_source is not None:
                self.ranks.send_tokens(input_source)
        hidden, sample_rows, context, positions = self._forward(step, input_source)
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
        drafts = (self.drafter.drafts(batch, step, context, positions, hidden, accepted, self.ranks)
                  if self.drafter else [])
        return StepResult(sampled, want.sample_seqs, self._prompt_logprobs(hidden, want.prompt_rows), accepted, drafts)

    @torch.inference_mode()
    def forward_step(self, step: HostStep, input_source: torch.Tensor | None = None,
                     sample_rows: list[int] = ()) -> None:
        """A step rank 0 runs, on another tensor-parallel rank: the same forward (graph replay or
        eager), whose all-reduces meet rank 0's, then the LM head on rank 0's sample rows (its gather
        meets rank 0's); the hidden states (and the MTP drafter's context) kept for the drafts and
        prompt log-prob rows rank 0 asks next."""
        self.last_hidden, _, self.last_context, self.last_positions = self._forward(step, input_source)
        if sample_rows:
            self.logits_rows(sample_rows)

    @torch.inference_mode()
    def draft(self, plan) -> None:
        """On another tensor-parallel rank: the MTP drafter's passes over the last step (rank 0's
        DraftPlan), whose all-reduces and gathers meet rank 0's."""
        self.drafter.run(plan, self.last_context, self.last_positions, self.last_hidden)

    @torch.inference_mode()
    def logits_rows(self, rows: list[int]) -> None:
        """On another tensor-parallel rank: the LM head over rows of the last step's hidden states,
        whose gather of the vocabulary's slices meets rank 0's (layers/embed_head.py)."""
        self.model.compute_logits(self.last_hidden[torch.tensor(rows, dtype=torch.int64).to(self.device)])

    def _tell_logits(self, rows: list[int]) -> None:
        """Rank 0, before an LM head call past the sample rows' (prompt log-probs): the rows, so that
        the other ranks' calls meet its gather."""
        if self.ranks is not None:
            self.ranks.send(("logits", list(rows)))

    def _forward(self, step: HostStep, input_source: torch.Tensor | None):
        """The model over the step: a CUDA-graph replay for a decode batch the graphs hold, else
        eager under the step's Context (built once). Returns (hidden, the device index of the
        sample rows or None, the Context and positions the MTP drafter runs under)."""
        if self.graphs is not None and step.images is None and self.graphs.can_run(step):
            hidden, sample_rows = self.graphs.run(step, input_source)
            # The MTP drafter runs eagerly after the replay, under the replayed step's metadata.
            context, positions = self.graphs.attention_context(step) if self.drafter else (None, None)
            return hidden, sample_rows, context, positions
        dev = to_device_step(step, self.device, self.step_ring, self.kda_backends)   # the step's Context, built once
        if input_source is not None:
            gather_inputs(dev.input_ids[: step.num_decodes], input_source)
        images = self.encoder_cache.apply(step.images) if step.images is not None else None
        set_context(dev.context)
        try:
            hidden = self.model(dev.input_ids, dev.positions, images=images)
        finally:
            reset_context()
        return hidden, dev.sample_rows, dev.context, dev.positions

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list) -> list:
        """Scored max_num_seqs rows at a time: [rows, vocab] fp32 logits of a whole scored prompt
        chunk (lm-eval's echo + logprobs) would be gigabytes the memory profile never reserved."""
        out = []
        per_call = self.config.max_num_seqs
        for i in range(0, len(prompt_rows), per_call):
            part = prompt_rows[i : i + per_call]
            self._tell_logits([r for _, r, _ in part])
            logits = self.model.compute_logits(hidden[torch.tensor([r for _, r, _ in part], device=self.device,
                                                                   dtype=torch.int64)])
            targets = torch.tensor([s.token_ids[t] for s, _, t in part], device=self.device)
            res = logprob_rows(logits, targets, [s.params.prompt_logprobs for s, _, _ in part])
            for (seq, _, t), (lp, top, rank) in zip(part, res):
                out.append((seq, t, {"token_id": seq.token_ids[t], "logprob": lp, "top": top, "rank": rank}))
        return out
