"""The engine: requests in, one scheduler step at a time, outputs out.

Thread-compatible in the simple sense: one thread at a time calls add_request / abort_request /
step (a server serializes them with a lock)."""

from __future__ import annotations

import logging
import threading
import time

from kdaserve.backends.requirements import usable_device
from kdaserve.engine.block_manager import BlockManager
from kdaserve.engine.config import EngineConfig
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.info import EngineInfo
from kdaserve.engine.memory import plan_memory
from kdaserve.engine.model_runner import ModelRunner, load_engine_model
from kdaserve.engine.output_processor import OutputProcessor
from kdaserve.engine.outputs import RequestOutput
from kdaserve.engine.prefix_cache import NoPrefixCache, PrefixCache
from kdaserve.engine.prefix_cache.checkpoints import StateCheckpoints
from kdaserve.engine.prefix_cache.hashing import BlockHasher
from kdaserve.engine.sampling_params import SamplingParams
from kdaserve.engine.scheduler import Scheduler
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.speculative.mtp_proposer import MtpProposer
from kdaserve.engine.speculative.ngram_proposer import NgramProposer
from kdaserve.engine.speculative.stats import SpecDecodeStats
from kdaserve.engine.state_pool import StateSlotPool
from kdaserve.engine.structured_output.params import StructuredOutputsParams
from kdaserve.engine.tensor_parallel import TensorParallelRanks, agree_on_memory
from kdaserve.engine.warmup import warm_up
from kdaserve.layers.distributed import TensorParallel, building_with, tensor_parallel

logger = logging.getLogger("kdaserve.engine")


def _make_proposer(spec):
    if spec is None:
        return None
    if spec.method == "mtp":
        return MtpProposer(spec.num_speculative_tokens)
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def _grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The drafts the grammar allows in a row (up to its end), the matcher left as it was: a
    draft the grammar forbids could never be accepted, and the verify rows' masks assume the
    drafts before them are valid."""
    n = 0
    for d in drafts:
        if matcher.is_terminated() or not matcher.accept_token(d):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]


class LLMEngine:
    """Schedules: requests in, one step at a time through the model runner, outputs out (the
    output processor reads what each step made). Built in order: the model (its KDA backends
    resolved once by the loader), the memory plan, the pools it sizes, then the runner."""

    def __init__(self, model: str = "tiny", **kwargs):
        self.config = cfg = EngineConfig(model=model, **kwargs)
        usable_device(cfg.device)   # a device this machine cannot run on: one line saying why, before loading
        # Tensor parallel: the other ranks start first and build their shards beside this one.
        self.ranks = TensorParallelRanks(cfg) if cfg.tensor_parallel_size > 1 else None
        try:
            with building_with(self.ranks.state if self.ranks is not None else TensorParallel()):
                self._build(cfg)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: EngineConfig) -> None:
        loaded = load_engine_model(cfg)
        memory = plan_memory(cfg, loaded.model, loaded.config.max_position_embeddings)
        self.memory = memory = agree_on_memory(memory, tensor_parallel())   # every rank's pools the same size
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        self.max_model_len: int = memory.max_model_len
        self.vocab_size: int = loaded.config.vocab_size
        # Images (a model with a vision tower): the placeholder token and the processing rules.
        self.image_token_id: int | None = getattr(loaded.model, "image_token_id", None)
        self.image_rules = loaded.model.image_rules if self.image_token_id is not None else None   # the checkpoint's
        self.kda_backends = loaded.kda_backends
        self.slots = StateSlotPool(memory.num_running_slots)
        self.blocks = BlockManager(memory.num_kv_blocks, cfg.block_size)
        self.prefix_cache = self._make_prefix_cache() if cfg.enable_prefix_caching else NoPrefixCache()
        self.scheduler = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.slots, self.blocks,
                                   num_spec_tokens=cfg.num_spec_tokens, prefix_cache=self.prefix_cache,
                                   lookahead=cfg.draft_lookahead, max_model_len=self.max_model_len)
        self.runner = ModelRunner(cfg, loaded, memory, self.ranks)
        spec = cfg.speculative_config
        self.proposer = _make_proposer(spec)
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []    # outputs of aborted requests, sent by the next step
        # overlapped_steps: steps queued before the tokens of the step before were read (async scheduling).
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0, "overlapped_steps": 0}
        # A config may list several end tokens (GLM: endoftext, <|user|>, <|observation|>) beside the
        # tokenizer's; any of them ends a request.
        eos = loaded.config.eos_token_id
        self.output = OutputProcessor(
            eos_token_ids=[self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])],
            max_model_len=self.max_model_len, num_spec_tokens=cfg.num_spec_tokens, counters=self.counters,
            finish=self._finish, proposer=self.proposer, spec_stats=self.spec_stats)
        self.runner.sampler.stop_ids = self.output.stop_ids
        # After the CUDA graphs (captured by the runner), before any request. Only where kernels are
        # compiled: on the CPU (torch ops, Triton's interpreter) there is nothing to win.
        if cfg.warmup and cfg.device.type == "cuda":
            self.warm_up()
        # Async scheduling: the step queued on the device whose tokens the next step() reads.
        self.async_scheduling = cfg.async_scheduling
        self._inflight = None
        logger.info("async scheduling: %s", "on (a decode step is queued before the previous step's tokens are read)"
                    if self.async_scheduling else
                    "off (speculative decoding runs one step at a time)" if self.proposer is not None else "off")
        self.last_step_tokens = 0   # tokens the last step computed (prompt + decode): vLLM's iteration tokens
        self._grammar_compiler = None   # built on the first structured request (xgrammar imported then)
        self._grammar_lock = threading.Lock()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at one rank). The engine takes no
        step after it."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def info(self) -> EngineInfo:
        """All a server reads of this engine (sent by the engine process when it is ready)."""
        return EngineInfo(model_name=self.model_name, config=self.config, tokenizer=self.tokenizer,
                          max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                          stop_ids=tuple(sorted(self.output.stop_ids)), num_kv_blocks=self.memory.num_kv_blocks,
                          num_state_slots=self.memory.num_slots,
                          kda_backends=self.kda_backends.names if self.kda_backends is not None else None,
                          image_token_id=self.image_token_id, image_rules=self.image_rules)

    def _make_prefix_cache(self) -> PrefixCache:
        cfg, memory = self.config, self.memory
        checkpoints = StateCheckpoints(memory.num_running_slots, memory.num_checkpoint_slots)
        backends = self.kda_backends
        prefill = backends.prefill.name if backends is not None else "none"
        in_step = backends is not None and backends.takes_checkpoints_in_step
        how = ("writes the checkpoints a prefill chunk crosses inside its launch" if in_step else
               "writes no interior states, so prefill chunks are cut at a checkpoint boundary (at most one extra step "
               "per prompt)")
        logger.info("prefix caching: KDA state checkpoints every %d tokens, %d checkpoint slots (at most %d per request); "
                    "the %s prefill backend %s", cfg.mamba_block_size, memory.num_checkpoint_slots,
                    cfg.prefix_cache_states_per_request, prefill, how)
        return PrefixCache(self.blocks, checkpoints, BlockHasher(cfg.block_size, cfg.prefix_caching_hash_algo),
                           cfg.mamba_block_size, cfg.prefix_cache_states_per_request, speculative=cfg.num_spec_tokens > 0,
                           in_step=in_step)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix no running request holds (vLLM's reset_prefix_cache);
        False when prefix caching is off."""
        self.prefix_cache.clear()
        return self.prefix_cache.enabled

    def warm_up(self) -> int:
        """Dummy steps that compile the kernels' specializations now rather than in the first
        requests (engine/warmup.py); returns the number of steps. Needs an idle engine; leaves
        the pools empty and later outputs unchanged."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine (requests are queued or running)")
        return warm_up(self.runner, self.slots, self.blocks, self.memory, vocab_size=self.vocab_size,
                       tokenizer=self.tokenizer)

    # -- requests -----------------------------------------------------------------------------

    def compile_grammar(self, params: StructuredOutputsParams):
        """Compile (once; kept on `params`) a structured-output constraint for this model's
        vocabulary. Thread-safe: a server calls it in worker threads before add_request, so
        the engine's thread never waits on a compile. ValueError says what is wrong."""
        with self._grammar_lock:   # built once; compiles then run concurrently (xgrammar's compiler is thread-safe)
            if self._grammar_compiler is None:
                from kdaserve.engine.structured_output.compiler import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.output.stop_ids),
                                                         max_whitespace=self.config.structured_outputs_max_whitespace)
        return self._grammar_compiler.compile(params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    images: list | None = None) -> None:
        """Queue a request. Raises ValueError on bad input, leaving the engine untouched. `images`:
        the prompt's images in order (PIL images, or processed ones: place_images), one placeholder
        token each in the prompt (engine/multimodal.py)."""
        params = params if params is not None else SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use; expected a new id")
        ids, placed = self.place_images(prompt_token_ids, images)
        ids = self.validate_request(ids, params)
        seq = Sequence(request_id, ids, params, IncrementalDetokenizer(self.tokenizer, params.stop), placed)
        seq.stream_interval = max(seq.stream_interval, self.config.stream_interval)
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)
            seq.grammar = self._grammar_compiler.matcher(params.structured_outputs)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def place_images(self, prompt_token_ids: list[int], images: list | None):
        """(prompt ids with each image's placeholder expanded, the placed images); no images: as given.
        PIL images are processed here by the model's rules (pure host work); processed and placed
        ones pass through."""
        if not images:
            return prompt_token_ids, ()
        if self.image_token_id is None:
            raise ValueError(f"{self.model_name} takes no images" + (
                " (--limit-mm-per-prompt has image 0)" if self.config.max_images_per_prompt == 0 else
                ": it has no vision tower; send text only"))
        limit = self.config.max_images_per_prompt
        if len(images) > limit:
            raise ValueError(f"too many images: got {len(images)}; expected at most {limit} per prompt "
                             f"(--limit-mm-per-prompt '{{\"image\": N}}')")
        from kdaserve.engine.multimodal import place_images
        from kdaserve.models.glm5_next_images import process_image

        processed = [image if hasattr(image, "grid_thw") else process_image(image, self.image_rules) for image in images]
        return place_images(list(prompt_token_ids), self.image_token_id, processed)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Raise ValueError saying what is wrong with a request; returns its token ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"invalid params: got {type(params).__name__}; expected a SamplingParams")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else []
        if not ids:
            raise ValueError("invalid prompt: got an empty prompt; expected at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size))
            raise ValueError(f"invalid prompt token {bad!r}; expected integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt too long: got {len(ids)} tokens; expected at most {self.max_model_len - 1} "
                f"(max_model_len={self.max_model_len} includes at least one output token)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.config.max_logprobs:
                raise ValueError(f"invalid {name}: got {n}; expected at most max_logprobs={self.config.max_logprobs}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"invalid logit_bias token {max(params.logit_bias)}; expected ids in [0, {self.vocab_size})")
        if self.proposer is not None and params.has_logits_processors:
            raise ValueError("min_tokens, logit_bias, the penalties and min_p are not supported with speculative decoding "
                             "yet; send them to a server without --speculative-config, or leave them at their defaults")
        return ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its slot and blocks go back to the pools. The next step() reports
        it with finish_reason "abort". Unknown (or finished) ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        if self.proposer is not None:
            self.proposer.forget(seq)
        self._pending.append(self.output.output(seq, seq.new_token_ids))   # tokens a stream interval held back
        seq.new_token_ids = []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "state_slots_used": self.slots.num_used,
            "state_slots_total": self.slots.capacity,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.capacity,
            **self.counters,
            **(self.spec_stats.as_dict() if self.spec_stats is not None else {}),
            **self.prefix_cache.stats(),
        }

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns outputs of the requests that progressed (new tokens,
        prompt log-probs, finished or aborted).

        With async scheduling (EngineConfig.async_scheduling) a decode step's successor is
        queued on the device before the step's own tokens are read back, so the host's work on
        them (appending, stop checks, text, outputs) and the next step's preparation run while
        the device computes: a call then returns the outputs of the step before it, and one step
        stays in flight between calls (_complete_overlapped)."""
        outputs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        if prev is not None and self._complete_overlapped(*prev, outputs):
            return outputs
        # Nothing in flight (or the step before needed more than a decode batch): a step as is.
        if self.proposer is not None:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        self.counters["preemptions"] += len(batch.preempted)
        if batch.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                head = self.scheduler.waiting[0]
                raise RuntimeError(
                    f"engine stalled: request {head.request_id!r} ({head.num_tokens} tokens) cannot be admitted with "
                    f"nothing running ({self.slots.num_free} free state slots, {self.blocks.num_free} free KV blocks); "
                    f"resources were lost or the pools are too small"
                )
            return outputs
        self._complete_overlapped(batch, self._launch(batch), outputs)
        return outputs

    def _can_overlap(self, batch, result) -> bool:
        """Whether the step after `batch` may be queued before its tokens are read: a decode
        step whose every row samples (tokens on the device), with no sampling that depends on the
        tokens before it (grammars, penalties, min_tokens) and no prompt log-probs."""
        return (self.async_scheduling and not batch.prefills and result.accepted is None and not result.prompt_logprobs
                and getattr(result.sampled, "tokens", None) is not None
                and len(result.sample_seqs) == len(batch.decodes)
                and not any([s.logits_processed for s in batch.decodes]))

    def _complete_overlapped(self, batch, result, outputs: list) -> bool:
        """Complete the queued step `batch`, first queueing the next decode step on its device
        tokens where it can (_can_overlap, Scheduler.schedule_after), so that the host reads
        and handles `batch`'s tokens while the next step runs. False where nothing was queued:
        the next step needs the scheduler's full pass (admissions, preemption, a prefill)."""
        nxt = self.scheduler.schedule_after(result.sample_seqs) if self._can_overlap(batch, result) else None
        if nxt is None:
            self._complete(batch, result, outputs)
            return False
        self._inflight = (nxt, self._launch(nxt, result.sampled.tokens))
        self.counters["overlapped_steps"] += 1
        self._complete(batch, result, outputs)
        # The next step's input tokens are on the host now: its prefix-cache bookkeeping, whose
        # state copies must reach the stream before any later step does.
        self._after_forward(nxt)
        if all(s.is_finished for s in nxt.decodes):   # every request of it ended meanwhile: nothing to read
            self._inflight = None
        return True

    def _launch(self, batch, input_source=None):
        """Queue `batch` on the device and count what it computes."""
        scheduled_at = time.monotonic()
        for seq in batch.prefills:   # a decode was scheduled before, as a prefill
            seq.metrics.setdefault("first_scheduled_time", scheduled_at)
        result = self.runner.execute(batch, input_source)
        self.counters["steps"] += 1
        self.last_step_tokens = batch.num_tokens
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq, n in zip(batch.prefills, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.counters["prompt_tokens"] += n
        if batch.input_rows is None:   # an overlapped step's inputs reach the host later (_complete_overlapped)
            self._after_forward(batch)
        return result

    def _after_forward(self, batch) -> None:
        """Prefix caching: the full blocks the step completed and its checkpoints' state copies,
        queued behind its forward pass, before any request of it finishes and frees its slot."""
        self.runner.copy_states(self.prefix_cache.after_step(batch))

    def _complete(self, batch, result, outputs: list) -> None:
        """Read `batch`'s results (waiting for its tokens) into its requests and `outputs`."""
        self.output.process(batch, result, outputs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """A request ended by a stop rule (OutputProcessor): its slot and blocks go back."""
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq)

    def _propose_drafts(self) -> None:
        """Drafts for every running sequence whose next step is a verify, capped so that accepting
        them all (and the token after them) stays within max_tokens and max_model_len."""
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens == 0:
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            drafts = self.proposer.propose(seq, room)
            if seq.grammar is not None and drafts:
                drafts = _grammar_prefix(seq.grammar, drafts)
            seq.draft_token_ids = drafts
