"""Tensor parallelism's ranks: one process per rank, each bound to its device, in one
torch.distributed group (NCCL on GPUs, gloo on CPUs, so CI runs two ranks on its two cores).

Rank 0 is the engine process: it schedules, samples and answers; ranks 1..N-1 (`_rank_main`) each
load their shard of the model, size their pools by the same plan and run every step rank 0 runs,
in the same order, so the layers' all-reduces meet. Per step rank 0 sends the ranks small
host-side messages over a gloo group (`broadcast_object_list`): the step's HostStep (the per-step
form, without the sequences' objects), a state-slot copy, the LM head's rows for prompt log-probs,
the MTP drafter's plan after sampling (speculative/mtp_drafter.py), or stop; with async scheduling the
previous step's sampled tokens follow on the device group. Outputs come from rank 0 only.

A rank that dies takes the engine down: rank 0 watches the others' processes and exits with the
rank and its exit code within a second (a collective would otherwise wait for it forever); a
rank whose rank 0 is gone finds the group broken and exits."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import threading
from datetime import timedelta
from multiprocessing.connection import wait

import torch

from kdaserve.engine.config import EngineConfig
from kdaserve.engine.memory import MemoryPlan
from kdaserve.layers.distributed import TensorParallel, set_tensor_parallel

log = logging.getLogger("kdaserve.engine")



def collective_timeout() -> timedelta:
    """A collective that waits this long for a rank is an error (gloo and NCCL both honour it):
    $KDASERVE_COLLECTIVE_TIMEOUT_S seconds, default 600 (a first step may compile for minutes)."""
    return timedelta(seconds=float(os.environ.get("KDASERVE_COLLECTIVE_TIMEOUT_S", 600)))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (counting from the device the engine was given), the CPU as is."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


# The sizes a rank takes a share of, by config name (every family's that has them): a size the
# ranks cannot split evenly is refused before any rank starts.
_SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "linear_num_heads", "intermediate_size",
                "moe_intermediate_size", "vocab_size")   # vocab_size: the embedding's and LM head's rows


def check_ranks(config: EngineConfig) -> None:
    """Before any rank starts: more ranks than devices, a model size the ranks cannot split
    evenly, or expert parallelism without routed experts is a startup error that says what works."""
    from kdaserve.layers.distributed import split
    from kdaserve.models.loader import resolve_model

    n, device = config.tensor_parallel_size, config.device
    model_config = resolve_model(config.model, config.load_format, tokenizer=False)[0]
    ep = config.enable_expert_parallel
    for name in _SPLIT_SIZES:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0 and not (ep and name == "moe_intermediate_size"):
            split(value, f"the model's {name}", n)
    if ep:   # whole experts per rank: the routed experts' count splits, each expert's width does not
        router = _router(model_config)
        if router is None:
            raise ValueError(f"--enable-expert-parallel: {config.model} has no routed experts to split; leave it out")
        split(router.num_experts, "the model's routed experts (--enable-expert-parallel)", n)
    if device.type == "cuda":
        have = torch.cuda.device_count() - (device.index or 0)
        if n > have:
            raise ValueError(f"--tensor-parallel-size {n} needs {n} GPUs from {device}, but this machine has {have}; "
                             f"give at most -tp {have} (CUDA_VISIBLE_DEVICES picks which)")


def _router(model_config):
    """The model's router settings, None without routed experts."""
    try:
        return getattr(model_config, "router", None)
    except (ValueError, AttributeError):   # a config without experts may refuse to make a router
        return None


def _init_group(rank: int, size: int, port: int, device: torch.device, expert_parallel: bool) -> TensorParallel:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=collective_timeout())
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=collective_timeout()) if backend == "nccl" else group
    return TensorParallel(rank, size, group, cpu_group, expert_parallel)


def agree_on_memory(memory: MemoryPlan, tp: TensorParallel) -> MemoryPlan:
    """Every rank's pools the same size: the smallest attention pool any rank could hold (each
    sized its own from its free memory)."""
    if tp.size == 1:
        return memory
    import torch.distributed as dist

    blocks = torch.tensor([memory.num_kv_blocks], dtype=torch.int64)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return dataclasses.replace(memory, num_kv_blocks=int(blocks))


class TensorParallelRanks:
    """Rank 0's handle on the other ranks: started before the model is built (each rank builds its
    shard at the same time), then told every step. `close()` stops them."""

    def __init__(self, config: EngineConfig):
        import torch.distributed as dist

        if dist.is_initialized():
            raise ValueError("another tensor-parallel engine runs in this process: close it (LLMEngine.close()) first; "
                             "torch.distributed holds one group per process")
        check_ranks(config)
        self.size = n = config.tensor_parallel_size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # the group's rendezvous port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")   # CUDA cannot be forked
        self.processes = [ctx.Process(target=_rank_main, args=(config, r, n, port), name=f"kdaserve-tp-rank-{r}",
                                      daemon=True) for r in range(1, n)]
        for p in self.processes:
            p.start()
        atexit.register(self.close)
        self.device = rank_device(config.device, 0)
        self._closing = False
        self.state = _init_group(0, n, port, self.device, config.enable_expert_parallel)   # the model is built under it
        threading.Thread(target=self._watch, name="kdaserve-tp-watch", daemon=True).start()
        log.info("tensor parallel: %d ranks (%s), rank 0 schedules", n, "NCCL" if self.device.type == "cuda" else "gloo")

    def _watch(self) -> None:
        """A rank that exits while the engine runs: the engine cannot go on (the next collective
        would wait for it), so the process ends now, saying which rank and how."""
        sentinels = {p.sentinel: p for p in self.processes}
        ready = wait(list(sentinels))
        if self._closing:
            return
        p = sentinels[ready[0]]
        p.join(1)
        log.error("tensor parallel: %s exited (exit code %s); the engine stops", p.name, p.exitcode)
        os._exit(1)

    def send(self, message: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.state.cpu_group)

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """The previous step's sampled tokens (async scheduling), which the ranks' inputs index."""
        import torch.distributed as dist

        dist.broadcast(tokens, src=0, group=self.state.group)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self.send(("stop",))
        except Exception:   # noqa: BLE001 - a rank already gone: nothing to stop
            pass
        for p in self.processes:
            p.join(30)
            if p.is_alive():
                p.kill()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_main(config: EngineConfig, rank: int, size: int, port: int) -> None:
    """Ranks 1..N-1: their shard, the same memory plan and graphs as rank 0, then every step rank
    0 sends, until it says stop (or its group breaks: rank 0 is gone)."""
    import torch.distributed as dist

    from kdaserve.engine.memory import plan_memory
    from kdaserve.engine.model_runner import ModelRunner, load_engine_model

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s %(name)s[tp rank {rank}]: %(message)s")
    device = rank_device(config.device, rank)
    config = dataclasses.replace(config, device=device)
    state = _init_group(rank, size, port, device, config.enable_expert_parallel)
    set_tensor_parallel(state)   # this process is one rank: everything it builds is its shard
    try:
        loaded = load_engine_model(config)
        memory = agree_on_memory(plan_memory(config, loaded.model, loaded.config.max_position_embeddings), state)
        runner = ModelRunner(config, loaded, memory)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:   # a startup check: one line, as rank 0 says it
        log.error("cannot start: %s", exc)
        raise SystemExit(1) from None
    cpu_group = state.cpu_group
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=cpu_group)
            kind, *rest = box[0]
            if kind == "stop":
                break
            if kind == "copy":
                runner.copy_states(rest[0])
            elif kind == "step":
                step, num_tokens, sample_rows = rest
                source = None
                if num_tokens is not None:
                    source = torch.empty(num_tokens, dtype=torch.int64, device=device)
                    dist.broadcast(source, src=0, group=state.group)
                runner.forward_step(step, source, sample_rows)
            elif kind == "logits":
                runner.logits_rows(rest[0])
            elif kind == "draft":
                runner.draft(rest[0])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
