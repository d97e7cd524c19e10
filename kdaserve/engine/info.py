"""What a server reads of an engine, and all it reads: sent by the engine process when it is
ready (picklable), or taken from an LLMEngine in the same process."""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.engine.config import EngineConfig


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    config: EngineConfig
    tokenizer: object
    max_model_len: int
    vocab_size: int
    stop_ids: tuple[int, ...]       # every token that ends a request (EOS and the config's end tokens)
    num_kv_blocks: int              # attention blocks, the null block included (vLLM's num_gpu_blocks)
    num_state_slots: int            # KDA state slots, the null slot and prefix-cache checkpoints included
    kda_backends: str | None        # "prefill+decode" names, None without KDA layers
    image_token_id: int | None = None   # the image placeholder token; None: the model takes no images
    image_rules: object = None          # its image processing rules (models/glm5_next_images.ImageRules)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs
