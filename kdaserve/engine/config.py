"""Engine settings (the keyword arguments of LLMEngine / LLM), resolved and checked once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float64": torch.float64}


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    model: str = "tiny"
    kda_prefill_backend: str = "auto"
    kda_decode_backend: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None    # token budget per step (chunked prefill); None: 8192
    device: str | torch.device | None = None      # None: cuda when available, else cpu
    dtype: torch.dtype | str | None = None        # None: bf16 on GPU, fp32 on CPU
    enforce_eager: bool = False                   # no CUDA graphs
    seed: int = 0                                 # built-in weights and unseeded sampling
    block_size: int = 16                          # tokens per KV block
    num_kv_blocks: int | None = None              # None: from memory (GPU) or what max_num_seqs full sequences need (CPU)
    gpu_memory_utilization: float = 0.9
    state_dtype: torch.dtype | str = torch.float32  # KDA recurrent state
    conv_layout: str = "SD"
    max_logprobs: int = 20
    cuda_graph_max_batch_size: int | None = None  # None: max_num_seqs
    # Run dummy steps at startup so that kernel JIT specializations are compiled before the first
    # requests (engine/warmup.py), on a CUDA device (nothing is compiled on the CPU); graphs or not.
    warmup: bool = True

    def __post_init__(self):
        self.device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(self.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.state_dtype = parse_dtype(self.state_dtype) or torch.float32
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size", "max_logprobs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"invalid {name}: got {v!r}; expected an integer >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"invalid max_model_len: got {self.max_model_len}; expected >= 2 (a prompt token and an output token)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"invalid gpu_memory_utilization: got {self.gpu_memory_utilization}; expected a number in (0, 1]")

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager

    @property
    def kda_options(self) -> dict:
        return dict(prefill_backend=self.kda_prefill_backend, decode_backend=self.kda_decode_backend,
                    state_dtype=self.state_dtype, conv_layout=self.conv_layout)
