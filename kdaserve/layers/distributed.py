"""Tensor parallelism as the layers see it: this process's rank among the ranks that hold one
model, the one collective the layers make (the sum of row-parallel partial outputs), and the
slice of a checkpoint tensor a rank keeps.

Set while a model is built (`building_with`; engine/tensor_parallel.py starts the ranks); one rank
(the default) is the one-GPU engine: no group, no collective, every tensor whole. A layer keeps the
state it was built under (`self.tp`) for its collective. The layers size
their shards from `tp_size()` at construction: heads (KDA, attention, MLA), intermediate widths
(MLPs, experts); a row-parallel projection's output is this rank's partial sum, and the layer adds
the ranks' partial sums with `all_reduce` (one per attention block and one per MLP block)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None        # the ranks' device group (NCCL on GPUs, gloo on CPUs); None at size 1
    cpu_group: object = None    # a gloo group over the same ranks: the engine's per-step messages
    expert_parallel: bool = False   # MoE layers: whole experts per rank (E / size each) instead of each one's width


_STATE = TensorParallel()


def set_tensor_parallel(state: TensorParallel) -> None:
    global _STATE
    _STATE = state


@contextmanager
def building_with(state: TensorParallel):
    """The layers built inside take `state`'s shares and group (an engine builds its model under
    its own ranks' state, so one-rank and split engines can share a process); restored after."""
    before = _STATE
    set_tensor_parallel(state)
    try:
        yield state
    finally:
        set_tensor_parallel(before)


def tensor_parallel() -> TensorParallel:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum over `tp`'s ranks of each rank's partial `x`, in place (x itself at one rank). A
    layer passes the state it was built under (`self.tp`), never the process's current one: a
    one-rank model stays one-rank beside a split one in the same process (tests, tools)."""
    if tp.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=tp.group)
    return x


def split(total: int, what: str, size: int | None = None) -> int:
    """This rank's share of `total` (heads, experts' width, ...): a startup error naming `what`
    when the ranks cannot split it evenly."""
    size = size or _STATE.size
    if total % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide {what} ({total}); the sizes that do: "
                         f"{', '.join(str(n) for n in range(1, total + 1) if total % n == 0 and n <= 64)}")
    return total // size


def local_slice(tensor: torch.Tensor, local_shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """This rank's slice of a whole checkpoint tensor for a parameter of `local_shape`: along the
    one dimension where the tensor is `tp_size()` times the parameter (a column-parallel weight's
    rows, a row-parallel weight's columns), the rank's contiguous part; a replicated parameter
    (same shape) takes the tensor whole. Any other shape is returned as is, for the caller's
    shape check to name."""
    size = _STATE.size
    if size == 1 or tuple(tensor.shape) == tuple(local_shape) or tensor.dim() != len(local_shape):
        return tensor
    dims = [d for d, (a, b) in enumerate(zip(tensor.shape, local_shape)) if a != b]
    if len(dims) != 1 or tensor.shape[dims[0]] != local_shape[dims[0]] * size:
        return tensor
    d, n = dims[0], local_shape[dims[0]]
    return tensor.narrow(d, _STATE.rank * n, n)
