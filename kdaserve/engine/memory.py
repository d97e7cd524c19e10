"""How much of each pool an engine gets, decided once before the pools and the model runner are
built: the context length, the KDA state slots (running sequences and prefix-cache checkpoints)
and the attention cache's blocks (what the user asked, else what fits in the memory left after the
weights and a profiled forward, capped at what max_num_seqs sequences of max_model_len can use)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from kdaserve.engine.caches import format_bytes, kv_bytes_per_block, state_bytes_per_slot
from kdaserve.engine.config import EngineConfig
from kdaserve.engine.encoder_cache import encoder_call_tokens, warm_up_grid
from kdaserve.layers.context import reset_context

log = logging.getLogger("kdaserve.engine")

_CPU_KV_BYTES = 1 << 30   # default KV-cache budget on the CPU


@dataclass(frozen=True)
class MemoryPlan:
    max_model_len: int
    num_running_slots: int      # max_num_seqs * (S+1) state slots + the null slot
    num_checkpoint_slots: int   # the prefix cache's KDA checkpoints, slots after the running ones
    num_kv_blocks: int          # attention blocks, the null block included
    block_size: int
    report: dict | None = None  # GPU: GiB of state, attention cache and what was free (benchmarks print it)

    @property
    def num_slots(self) -> int:
        return self.num_running_slots + self.num_checkpoint_slots

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


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


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """--max-model-len, at most the model's context (a longer one is cut, with a warning)."""
    if config.max_model_len is None:
        return max_position_embeddings
    if config.max_model_len > max_position_embeddings:
        log.warning("max_model_len %d exceeds the model's max_position_embeddings; using %d",
                    config.max_model_len, max_position_embeddings)
    return min(config.max_model_len, max_position_embeddings)


def plan_memory(config: EngineConfig, model: nn.Module, max_position_embeddings: int) -> MemoryPlan:
    """The pools' sizes for `model` (loaded, caches not yet allocated) under `config`."""
    max_model_len = resolve_max_model_len(config, max_position_embeddings)
    running = config.max_num_seqs * (config.num_spec_tokens + 1) + 1
    checkpoints = config.prefix_cache_states if config.enable_prefix_caching else 0
    plan = MemoryPlan(max_model_len, running, checkpoints, 0, config.block_size)
    blocks, report = _num_kv_blocks(config, model, plan)
    return dataclasses.replace(plan, num_kv_blocks=blocks, report=report)


def _num_kv_blocks(config: EngineConfig, model: nn.Module, plan: MemoryPlan) -> tuple[int, dict | None]:
    cfg, per_seq = config, plan.blocks_per_seq
    enough = cfg.max_num_seqs * per_seq + 1
    if cfg.num_kv_blocks is not None:
        if cfg.num_kv_blocks < per_seq + 1:
            raise ValueError(
                f"num_kv_blocks={cfg.num_kv_blocks} cannot hold one sequence of max_model_len={plan.max_model_len} "
                f"({per_seq} blocks of {plan.block_size} + the null block); expected >= {per_seq + 1}"
            )
        return cfg.num_kv_blocks, None
    per_block = kv_bytes_per_block(model, plan.block_size, cfg.dtype)
    if per_block == 0:   # no full-attention layers: blocks are bookkeeping only
        return enough, None
    if cfg.device.type != "cuda":
        return max(per_seq + 1, min(enough, _CPU_KV_BYTES // per_block)), None
    free = _free_gpu_bytes(config, model, plan.max_model_len)
    per_slot = state_bytes_per_slot(model)
    one_seq = (per_seq + 1) * per_block
    state = plan.num_slots * per_slot
    gib = 2**30
    if state + one_seq > free:
        raise RuntimeError(capacity_error(
            max_num_seqs=cfg.max_num_seqs, num_spec_tokens=cfg.num_spec_tokens, per_slot=per_slot, state=state,
            one_seq=one_seq, per_block=per_block, block_size=plan.block_size, max_model_len=plan.max_model_len,
            free=free, gpu_memory_utilization=cfg.gpu_memory_utilization, num_checkpoint_slots=plan.num_checkpoint_slots))
    blocks = int(min(enough, (free - state) // per_block))
    report = {"state_gib": state / gib, "kv_gib": blocks * per_block / gib, "kv_tokens": blocks * plan.block_size,
              "free_gib": free / gib}
    log.info("memory: KDA state %.2f GiB (%d slots), attention cache %.2f GiB (%d blocks, %d tokens), of %.2f GiB "
             "left for caches", state / gib, plan.num_slots, blocks * per_block / gib, blocks, blocks * plan.block_size,
             free / gib)
    return blocks, report


@torch.inference_mode()
def _free_gpu_bytes(config: EngineConfig, model: nn.Module, max_model_len: int) -> int:
    """GPU bytes the caches may take: the utilization target minus what is in use and the
    peak of a dummy forward of a full token budget (activations) and, with a vision tower, of its
    largest call (engine/encoder_cache.encoder_call_tokens)."""
    device = config.device
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    T = min(config.max_num_batched_tokens, max_model_len)
    reset_context()   # no step metadata: KDA layers touch no state
    ids = torch.zeros(T, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(T, device=device))
    spec = config.speculative_config
    if spec is not None and spec.method == "mtp":   # the drafter's pass over the same rows
        model.draft_hidden(ids, torch.arange(T, device=device), hidden)
    # A step samples at most max_num_seqs rows, (S+1) times that with speculative decoding.
    model.compute_logits(hidden[: config.max_num_seqs * (config.num_spec_tokens + 1)])
    if getattr(model, "image_token_id", None) is not None:   # the vision tower's largest call: a warm-up image
        del hidden
        grid = warm_up_grid(encoder_call_tokens(config, model))
        p = model.image_rules.patch_size   # its canvas, turned into patches on the device as a request's is
        canvas = torch.zeros(model.visual.config.in_channels, grid[1] * p, grid[2] * p, dtype=torch.uint8, device=device)
        model.encode_images(model.image_pixels(canvas), [grid])
    reset_context()
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # The KDA prefill kernels' workspaces are not all exercised by a no-metadata run: keep a margin.
    margin = 2 * activations + (1 << 30)
    return int(free - (1 - config.gpu_memory_utilization) * total - margin)

