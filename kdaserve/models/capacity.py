"""Does a model's weights fit the device before anything is built? A model of hundreds of billions
of parameters (GLM-5.3-Flash: ~320B) would otherwise fail deep inside the allocator after minutes of
loading, and on a CPU the kernel's OOM killer ends the process without a word; this states the
numbers and the way forward instead. On a CPU the bound is the host memory available now."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from kdaserve.ops.fp4.weights import scale_row_bytes

GIB = 2**30


def parameter_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def weights_fit_error(name: str, num_params: int, dtype: torch.dtype, device_bytes: int,
                      fp8_params: int = 0, host: bool = False, tp_size: int = 1, replicated_params: int = 0,
                      fp4_params: int = 0, fp4_bytes: float = 0.0) -> str | None:
    """None when the weights alone fit `device_bytes`; else the message to stop with.
    `fp8_params`: how many of them stay FP8 (one byte each); `fp4_params`: how many stay 4-bit,
    taking `fp4_bytes` with their scales (ops/fp4/weights.py). `host`: the device is the CPU and
    `device_bytes` the host memory available now. `tp_size` ranks share the weights (one GPU each:
    every GPU holds 1/tp_size of them plus the `replicated_params` every rank keeps whole; on a CPU
    the ranks share the host's memory)."""
    size = torch.empty((), dtype=dtype).element_size()
    need = (num_params - fp8_params - fp4_params) * size + fp8_params + fp4_bytes
    if tp_size > 1 and not host:
        need = (need - replicated_params * size) / tp_size + replicated_params * size
    elif tp_size > 1:
        need += replicated_params * size * (tp_size - 1)
    if need <= device_bytes:
        return None
    if tp_size > 1 and not host:
        return (f"{name} needs {need / GIB:.0f} GiB of weights on each of {tp_size} GPUs at --tensor-parallel-size "
                f"{tp_size} ({num_params / 1e9:.1f}B parameters in {str(dtype).removeprefix('torch.')}"
                f"{', FP8 where kept' if fp8_params else ''}), but each GPU has {device_bytes / GIB:.0f} GiB: give a "
                f"larger --tensor-parallel-size, or --quantization fp8 where the family has it")
    kept, formats = ((f" ({fp8_params / 1e9:.1f}B of them in FP8)", " and FP8") if fp8_params else
                     (f" ({fp4_params / 1e9:.1f}B of them in 4 bits)", " and 4 bits") if fp4_params else ("", ""))
    head = (f"{name} has {num_params / 1e9:.1f}B parameters{kept}: {need / GIB:.0f} GiB of weights in "
            f"{str(dtype).removeprefix('torch.')}{formats}, but ")
    if host:
        return head + (f"this machine has {device_bytes / GIB:.1f} GiB of memory available, so it cannot run the model "
                       f"on its CPU (it would be killed for memory partway through building it). On a CPU use a small "
                       f"configuration (nano, kimi-tiny, glm-tiny, ling-tiny, or a checkpoint with fewer layers); the released "
                       f"shapes need GPUs")
    fits = math.ceil(need / device_bytes)
    smaller = "" if fp4_params else f" (FP8 weights would still need {num_params / GIB:.0f} GiB)"
    return head + (f"this device has {device_bytes / GIB:.0f} GiB in all, "
                   f"so it cannot serve the model on one GPU{smaller}. "
                   f"Split it over GPUs of this host with --tensor-parallel-size (at least {fits} by the weights alone; "
                   f"docs/parallelism.md), or past one host with vLLM and kdaserve's KDA kernels (docs/models.md, 'Past "
                   f"one GPU'); for kernel work on one GPU, use a configuration with fewer layers")


def _replicated(name: str) -> bool:
    """Tensors every tensor-parallel rank keeps whole: norms, routers, the latent projections and a
    vision tower (an estimate for the startup check; the layers decide). The embedding and LM head
    split by rows."""
    return any(k in name for k in ("norm", "gate.weight", "kv_a_proj", "q_a_proj", "f_a_proj", "g_a_proj", "hc_",
                                   "visual."))


def host_memory_available() -> int:
    """Bytes of host memory the kernel says a new allocation can take now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_weights_fit(name: str, shapes: dict[str, tuple[int, ...]] | None, dtype: torch.dtype, device,
                      fp8: Callable[[str], bool] | None = None, tp_size: int = 1,
                      fp4: Callable[[str], int | None] | None = None) -> None:
    """`fp8`: which checkpoint tensors the model keeps in FP8; `fp4`: the group size of each tensor
    it keeps in 4 bits (None for the others). `tp_size`: ranks sharing the weights (the embedding,
    LM head and norms stay whole on every rank)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if shapes is None or device.type not in ("cuda", "cpu"):
        return
    host = device.type == "cpu"
    total = host_memory_available() if host else torch.cuda.get_device_properties(device).total_memory
    fp8_params = parameter_count({n: s for n, s in shapes.items() if fp8(n)}) if fp8 is not None else 0
    replicated = parameter_count({n: s for n, s in shapes.items() if _replicated(n)}) if tp_size > 1 else 0
    groups = {n: fp4(n) for n in shapes} if fp4 is not None else {}
    fp4_params = sum(math.prod(shapes[n]) for n, g in groups.items() if g)
    # a packed half byte per value, a one-byte scale per group (rows padded to 16 bytes), NVFP4's fp32 divisor per row
    fp4_bytes = sum(math.prod(shapes[n][:-1]) * (shapes[n][-1] / 2 + scale_row_bytes(shapes[n][-1] // g) + (4 if g == 16 else 0))
                    for n, g in groups.items() if g)
    message = weights_fit_error(name, parameter_count(shapes), dtype, total, fp8_params, host=host, tp_size=tp_size,
                                replicated_params=replicated, fp4_params=fp4_params, fp4_bytes=fp4_bytes)
    if message:
        raise ValueError(message)
