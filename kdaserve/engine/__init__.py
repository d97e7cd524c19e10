"""The engine: requests, scheduler, state-slot and KV-block pools, step metadata, model runner,
CUDA graphs, sampler (nano-vllm's shape, plus the recurrent state of KDA layers)."""

from kdaserve.engine.llm import LLM
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine.outputs import RequestOutput
from kdaserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
