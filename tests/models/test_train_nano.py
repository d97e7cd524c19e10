"""tools/train_nano.py's checkpoint: a trained transformers model written under the released
tensor names (the dense first layer included), reloaded by transformers with the trained values,
and loaded by kdaserve."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file

from kdaserve.models.kimi_linear import random_released_tensors
from kdaserve.models.loader import load_model
from tools.train_nano import nano_config, save_checkpoint


def test_saved_checkpoint_round_trips(tmp_path):
    config = nano_config()
    config.hidden_size, config.num_hidden_layers = 64, 3
    config.layer_types = ["linear_attention", "linear_attention", "full_attention"]
    config.linear_head_dim, config.kv_lora_rank, config.moe_intermediate_size, config.intermediate_size = 16, 32, 32, 64
    init = tmp_path / "init"
    init.mkdir()
    config.save(init / "config.json")
    tensors = {k: v.contiguous() for k, v in random_released_tensors(config, 1, dtype=torch.float32)}
    save_file(tensors, str(init / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    with torch.no_grad():   # "training": every parameter moves away from its initial value
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_checkpoint(model, config, sorted(tensors), tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(b, a.to(torch.bfloat16).float(), msg=name)
    x = torch.tensor([[1, 2, 3, 4, 5]])
    loaded = load_model(str(tmp_path / "out"), device="cpu", dtype=torch.float32)
    assert loaded.config.num_hidden_layers == 3
    with torch.no_grad():
        assert torch.isfinite(again(input_ids=x).logits).all()
