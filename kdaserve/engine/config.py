"""Engine settings (the keyword arguments of LLMEngine / LLM), resolved and checked once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.backends.kda_backends import KDABackendChoice
from kdaserve.backends.requirements import parse_device
from kdaserve.engine.json_flag import json_object
from kdaserve.engine.speculative.config import SpeculativeConfig
from kdaserve.engine.structured_output.compiler import DEFAULT_MAX_WHITESPACE

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


def _flag(help: str, name: str | None = None, boolean_optional: bool = False, aliases: tuple[str, ...] = (),
          **argparse_kw) -> dict:
    """Field metadata for the command-line flag of an engine setting (engine/args.py reads it).
    `name` overrides the flag derived from the field name, where vLLM calls the setting otherwise;
    `boolean_optional`: a --flag / --no-flag pair, as vLLM spells its on-by-default switches;
    `aliases`: vLLM's short forms (-tp)."""
    return {"help": help, "flag": name, "argparse": argparse_kw, "boolean_optional": boolean_optional,
            "aliases": aliases}


DEFAULT_IMAGES_PER_PROMPT = 8


def parse_mm_limits(value) -> dict[str, int]:
    """--limit-mm-per-prompt (a dict or its JSON) -> {"image": N}: images only; a video limit above 0
    is refused (kdaserve takes no video)."""
    if value is None:
        return {"image": DEFAULT_IMAGES_PER_PROMPT}
    value = json_object(value, "limit_mm_per_prompt", '{"image": 2}')
    out = {"image": DEFAULT_IMAGES_PER_PROMPT}
    for k, v in value.items():
        n = v.get("count") if isinstance(v, dict) else v   # vLLM also takes {"image": {"count": N, ...}}
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"invalid limit_mm_per_prompt[{k!r}]: got {v!r}; expected an integer >= 0")
        if k == "image":
            out["image"] = n
        elif k in ("video", "audio") and n > 0:
            raise ValueError(f"limit_mm_per_prompt: kdaserve takes images only, not {k}; give {{\"{k}\": 0}} or leave it out")
        elif k not in ("video", "audio"):
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r}; expected \"image\"")
    return out


@dataclass
class EngineConfig:
    model: str = field(default="tiny", metadata=_flag(
        "nano (trained, shipped in the package), a built-in model with random weights for shapes and tests (tiny, "
        "bench, kimi-tiny, glm-tiny, ling-tiny: their text is random bytes), a released name (moonshotai/Kimi-Linear-"
        "48B-A3B-Instruct, zai-org/GLM-5.3-Flash, inclusionAI/Ling-3.0-Flash, with --load-format dummy) or a checkpoint "
        "directory"))
    tokenizer: str | None = field(default=None, metadata=_flag(
        "a directory whose tokenizer (tokenizer.json or tiktoken.model) replaces the model's"))
    load_format: str = field(default="auto", metadata=_flag(
        "auto or safetensors: the checkpoint's weights; dummy: random weights at the model's real shape",
        choices=("auto", "safetensors", "dummy")))
    quantization: str | None = field(default=None, metadata=_flag(
        "fp8: block-scaled FP8 weights (experts and linear projections; a bf16 checkpoint is quantized at load, "
        "128 x 128 blocks); default: the checkpoint's own format (an FP8 checkpoint keeps its experts in FP8 where "
        "FP8 dots run, KDASERVE_FP8_WEIGHTS); mxfp4 / quark / compressed-tensors: the checkpoint's own 4-bit format "
        "(checked; recognised without the flag too; experts and MLPs stay 4-bit, KDASERVE_FP4_WEIGHTS), or with "
        "--load-format dummy random weights with MXFP4 / NVFP4 experts", choices=("fp8", "mxfp4", "quark", "compressed-tensors")))
    kda_prefill_backend: str = field(default="auto", metadata=_flag(
        "KDA prefill backend; auto picks the fastest whose requirements hold (kdaserve info lists them)"))
    kda_decode_backend: str = field(default="auto", metadata=_flag(
        "KDA decode backend; auto picks the fastest whose requirements hold (kdaserve info lists them)"))
    mla_backend: str = field(default="auto", metadata=_flag(
        "MLA attention kernels: auto (Triton on a GPU, torch on a CPU), reference or triton",
        choices=("auto", "reference", "triton")))
    moe_backend: str = field(default="auto", metadata=_flag(
        "mixture-of-experts kernels: auto (Triton on a GPU, torch on a CPU), reference or triton",
        choices=("auto", "reference", "triton")))
    tensor_parallel_size: int = field(default=1, metadata=_flag(
        "ranks (GPUs, or CPU processes) that hold one model, each a process of its own: attention, KDA and MLA heads "
        "and the MLPs' and experts' widths split over them (docs/parallelism.md)", aliases=("-tp",)))
    enable_expert_parallel: bool = field(default=False, metadata=_flag(
        "with --tensor-parallel-size N: whole experts on each rank (E / N each) instead of every expert's width split"))
    max_num_seqs: int = field(default=64, metadata=_flag("sequences in one running batch"))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "prompt + completion tokens per request (default: the model's context, max_position_embeddings)"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        "token budget of one engine step (chunked prefill splits longer prompts); default 8192"))
    device: str | torch.device | None = field(default=None, metadata=_flag("cuda, cpu, ... (default: the GPU when there is one)"))
    dtype: torch.dtype | str | None = field(default=None, metadata=_flag(
        "weights and activations: auto, bfloat16, float16 or float32 (auto: bf16 on a GPU, fp32 on a CPU)"))
    enforce_eager: bool = field(default=False, metadata=_flag("no CUDA graphs"))
    seed: int = field(default=0, metadata=_flag("the engine's seed: built-in weights and requests without a seed of their own"))
    block_size: int = field(default=16, metadata=_flag("tokens per attention KV-cache block"))
    num_kv_blocks: int | None = field(default=None, metadata=_flag(
        "KV-cache blocks to allocate instead of sizing them from memory (GPU) or max_num_seqs full sequences (CPU)",
        name="--num-gpu-blocks-override"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_flag("share of the GPU's memory the engine may use, in (0, 1]"))
    state_dtype: torch.dtype | str = field(default=torch.float32, metadata=_flag(
        "dtype of the KDA recurrent state: float32, or bfloat16 to halve decode traffic at some accuracy cost",
        name="--mamba-ssm-cache-dtype"))
    conv_layout: str = field(default="SD", metadata=_flag(
        "KDA conv-state layout: SD (sequence-major) or DS (channel-major)", name="--kda-conv-layout",
        choices=("SD", "DS")))
    max_logprobs: int = field(default=20, metadata=_flag("most logprobs a request may ask for per token"))
    structured_outputs_max_whitespace: int = field(default=DEFAULT_MAX_WHITESPACE, metadata=_flag(
        "JSON structured output: at most this many whitespace characters in a row between JSON tokens (a small "
        "model otherwise writes '{' then whitespace until max_tokens); 0: unbounded"))
    cuda_graph_max_batch_size: int | None = field(default=None, metadata=_flag(
        "largest decode batch captured as a CUDA graph (default: max_num_seqs, at most 512 as vLLM's)",
        name="--max-cudagraph-capture-size"))
    speculative_config: dict | str | SpeculativeConfig | None = field(default=None, metadata=_flag(
        'speculative decoding, as a JSON object in vLLM\'s spelling: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup), or {"method": "mtp", "num_speculative_tokens": 2} '
        '(the model\'s multi-token-prediction layer: GLM-5.3-Flash); lossless: greedy outputs are unchanged, sampled '
        'ones keep their distribution'))
    # On by default, as in vLLM: on the H200 it cost nothing measurable without hits (docs/perf-notes.md,
    # "Prefix caching") and cut an 8K shared prompt's time to first token to a tenth.
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "reuse a shared prompt prefix's attention blocks and KDA state (engine/prefix_cache); "
        "--no-enable-prefix-caching turns it off", boolean_optional=True))
    prefix_caching_hash_algo: str = field(default="sha256", metadata=_flag(
        "hash of a prefix's blocks: sha256 (pickle + SHA-256) or xxhash (faster, not cryptographic; needs xxhash)",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")))
    mamba_block_size: int | None = field(default=None, metadata=_flag(
        "prefix caching: tokens between KDA state checkpoints, a multiple of --block-size (default: 32 blocks)"))
    prefix_cache_states: int | None = field(default=None, metadata=_flag(
        "prefix caching: KDA state checkpoints kept (state slots beside the running requests'; default: max_num_seqs / 2)"))
    prefix_cache_states_per_request: int = field(default=4, metadata=_flag(
        "prefix caching: checkpoints one request may take (past it: the one ending its prompt and the newest stay); "
        "caps what one long prompt or answer holds"))
    async_scheduling: bool | None = field(default=None, metadata=_flag(
        "queue a decode step before the previous step's tokens are read back, so that the host's work per step "
        "runs while the device computes (steps with prefills, grammars, penalties or min_tokens run one at a time); "
        "default: on with a GPU, except with speculative decoding, which it does not support yet (on a CPU the "
        "device works in the host's own thread: nothing to overlap); --no-async-scheduling turns it off",
        boolean_optional=True))
    stream_interval: int = field(default=1, metadata=_flag(
        "tokens batched into each output of a request before it is reported (vLLM's): 1 reports every token; "
        "larger values report every N tokens (the first token and the end at once), less host work per token "
        "at many streams; a request's stream_interval may raise it"))
    limit_mm_per_prompt: dict | str | None = field(default=None, metadata=_flag(
        'images one prompt may hold, as vLLM\'s JSON object: {"image": N} (default 8; 0 serves a vision-language '
        'model as text only, its vision tower not loaded); video is not taken'))
    # Run dummy steps at startup so that kernel JIT specializations are compiled before the first
    # requests (engine/warmup.py), on a CUDA device (nothing is compiled on the CPU); graphs or not.
    warmup: bool = field(default=True, metadata=_flag(
        "skip the start-up warm-up that compiles the kernels' variants before the first request (GPU only)",
        name="--no-warmup"))

    def __post_init__(self):
        # A description (tests build GPU configs on a CPU); LLMEngine checks the device can run.
        self.device = parse_device(self.device)
        self.dtype = parse_dtype(self.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.state_dtype = parse_dtype(self.state_dtype) or torch.float32
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size", "max_logprobs",
                     "stream_interval", "tensor_parallel_size"):
            v = getattr(self, name)
            if v is None and name == "max_model_len":   # the model's; the runner reads it from the model config
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"invalid {name}: got {v!r}; expected an integer >= 1")
        v = self.structured_outputs_max_whitespace
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"invalid structured_outputs_max_whitespace: got {v!r}; expected an integer >= 0 "
                             "(0: unbounded)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"invalid max_model_len: got {self.max_model_len}; expected >= 2 (a prompt token and an output "
                             "token)")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"invalid load_format: got {self.load_format!r}; expected auto, safetensors or dummy")
        if self.quantization not in (None, "fp8", "mxfp4", "quark", "compressed-tensors"):
            raise ValueError(f"invalid quantization: got {self.quantization!r}; expected fp8, mxfp4, quark, "
                             f"compressed-tensors or none (the checkpoint's own)")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.mamba_block_size is None:
            self.mamba_block_size = 32 * self.block_size
        for name in ("mamba_block_size", "prefix_cache_states_per_request"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"invalid {name}: got {v!r}; expected an integer >= 1")
        if self.mamba_block_size % self.block_size:
            raise ValueError(f"invalid mamba_block_size: got {self.mamba_block_size}; expected a multiple of "
                             f"block_size={self.block_size} (a KDA checkpoint ends where a KV block does)")
        if self.prefix_cache_states is None:
            # Half a batch of states: a few shared prefixes are the common case, each checkpoint
            # costs a whole state slot.
            self.prefix_cache_states = max(1, self.max_num_seqs // 2) if self.enable_prefix_caching else 0
        if not isinstance(self.prefix_cache_states, int) or self.prefix_cache_states < 0:
            raise ValueError(f"invalid prefix_cache_states: got {self.prefix_cache_states!r}; expected an integer >= 0")
        if self.enable_prefix_caching:
            from kdaserve.engine.prefix_cache.hashing import hash_function

            hash_function(self.prefix_caching_hash_algo)   # unknown or unavailable: ValueError now
        if self.max_num_batched_tokens < self.num_spec_tokens + 1:
            raise ValueError(f"invalid max_num_batched_tokens: got {self.max_num_batched_tokens}; a verify step of "
                             f"num_speculative_tokens + 1 = {self.num_spec_tokens + 1} tokens must fit")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling is not supported with speculative decoding yet; drop --async-scheduling "
                             "or --speculative-config")
        if self.async_scheduling is None:
            self.async_scheduling = self.speculative_config is None and self.device.type == "cuda"
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-expert-parallel splits the experts over the ranks of --tensor-parallel-size N; "
                             "at one rank every expert is whole already: give -tp N (N > 1) or leave it out")
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"invalid gpu_memory_utilization: got {self.gpu_memory_utilization}; expected a number in (0, 1]")

    @property
    def max_images_per_prompt(self) -> int:
        return self.limit_mm_per_prompt["image"]

    @property
    def num_spec_tokens(self) -> int:
        """S draft tokens per verify step; 0 without speculative decoding."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def draft_lookahead(self) -> int:
        """Cache positions a sampling step reserves past its own for the drafter: the MTP layer's
        passes after the first write rows at the S-1 positions after the newest token."""
        spec = self.speculative_config
        return spec.num_speculative_tokens - 1 if spec is not None and spec.method == "mtp" else 0

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager

    @property
    def kda(self) -> KDABackendChoice:
        """The KDA backend choice, frozen; the model resolves it once."""
        return KDABackendChoice(self.kda_prefill_backend, self.kda_decode_backend, self.state_dtype, self.conv_layout,
                                self.num_spec_tokens)
