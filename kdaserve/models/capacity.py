"""Does a model's weights fit the device before anything is built? A model of hundreds of billions
of parameters (GLM-5.3-Flash: ~320B) would otherwise fail deep inside the allocator after minutes of
loading, and on a CPU the kernel's OOM killer ends the process without a word; this states the
numbers and the way forward instead. On a CPU the bound is the host memory available now."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

GIB = 2**30


def parameter_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def weights_fit_error(name: str, num_params: int, dtype: torch.dtype, device_bytes: int,
                      fp8_params: int = 0, host: bool = False) -> str | None:
    """None when the weights alone fit `device_bytes`; else the message to stop with.
    `fp8_params`: how many of them stay FP8 (one byte each). `host`: the device is the CPU and
    `device_bytes` the host memory available now."""
    need = (num_params - fp8_params) * torch.empty((), dtype=dtype).element_size() + fp8_params
    if need <= device_bytes:
        return None
    kept, formats = ((f" ({fp8_params / 1e9:.1f}B of them in FP8)", " and FP8") if fp8_params else ("", ""))
    head = (f"{name} has {num_params / 1e9:.1f}B parameters{kept}: {need / GIB:.0f} GiB of weights in "
            f"{str(dtype).removeprefix('torch.')}{formats}, but ")
    if host:
        return head + (f"this machine has {device_bytes / GIB:.1f} GiB of memory available, so it cannot run the model "
                       f"on its CPU (it would be killed for memory partway through building it). On a CPU use a small "
                       f"configuration (nano, kimi-tiny, glm-tiny, or a checkpoint with fewer layers); the released "
                       f"shapes need GPUs")
    return head + (f"this device has {device_bytes / GIB:.0f} GiB in all, "
                   f"so it cannot serve the model on one GPU (FP8 weights would still need {num_params / GIB:.0f} GiB). "
                   f"Serve it across several GPUs with vLLM and kdaserve's KDA kernels (docs/models.md, 'Past one GPU'); "
                   f"for kernel work on one GPU, use a configuration with fewer layers")


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
                      fp8: Callable[[str], bool] | None = None) -> None:
    """`fp8`: which checkpoint tensors the model keeps in FP8."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if shapes is None or device.type not in ("cuda", "cpu"):
        return
    host = device.type == "cpu"
    total = host_memory_available() if host else torch.cuda.get_device_properties(device).total_memory
    fp8_params = parameter_count({n: s for n, s in shapes.items() if fp8(n)}) if fp8 is not None else 0
    message = weights_fit_error(name, parameter_count(shapes), dtype, total, fp8_params, host=host)
    if message:
        raise ValueError(message)
