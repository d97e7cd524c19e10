"""Tensor parallelism on the CPU (gloo, two ranks: CI's two cores): the same model split over two
processes gives the greedy tokens and prompt log-probs of one rank, alone and batched, with
chunked prefill, preemption, prefix-cache hits, async scheduling, n-gram and MTP speculation; sizes
the ranks cannot split and unbuilt features are refused before any rank starts; a rank that dies
ends the engine within seconds, naming it."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
# Chunked prefill (48-token budget), preemption (14 KV blocks of 16 for four sequences of up to ~100
# tokens), prefix-cache checkpoints every 32 tokens, async scheduling (the sampled tokens go to rank 1).
ENGINE = dict(device="cpu", max_num_seqs=4, max_model_len=160, max_num_batched_tokens=48, num_kv_blocks=14,
              block_size=16, mamba_block_size=32, async_scheduling=True, seed=0)
# A rank out of step shows as a collective's timeout: a minute, not the default ten.
os.environ.setdefault("KDASERVE_COLLECTIVE_TIMEOUT_S", "60")
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (5, 23, 70, 41)]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=1)
# Without prompt log-probs (a request that asks for them computes its whole prompt: no prefix-cache hit).
CACHED = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)


def _compare(one, two) -> None:
    assert [o.output_token_ids for o in one] == [o.output_token_ids for o in two]
    for a, b in zip(one, two):
        for x, y in zip((a.prompt_logprobs or [None])[1:] + (a.logprobs or []),
                        (b.prompt_logprobs or [None])[1:] + (b.logprobs or [])):
            assert x["token_id"] == y["token_id"] and abs(x["logprob"] - y["logprob"]) < 1e-4, (x, y)


@pytest.fixture(params=["nano", "kimi-tiny", "glm-tiny", "ling-tiny", "glm-tiny+ep", "ling-tiny+ep"])
def ranks(request):
    """The model on one rank and on two (KDA, MLA, MoE and dense layers; GLM's DSA indexer and
    hyper-connections; Ling-3's full-rank gates, gated MLA with RoPE and grouped routing), the same
    settings; `+ep`: with --enable-expert-parallel (whole experts per rank, 4 or 8 each, the shared
    expert's width split)."""
    model, _, ep = request.param.partition("+")
    one = LLM(model, **ENGINE)
    two = LLM(model, tensor_parallel_size=2, enable_expert_parallel=ep == "ep", **ENGINE)
    if ep:
        moe = [m for m in two.engine.runner.model.modules() if hasattr(m, "expert_parallel")]
        assert moe and all(m.expert_parallel and m.w13.shape[0] == m.router.num_experts // 2 for m in moe)
    yield one, two
    two.engine.close()


def test_two_ranks_give_one_ranks_tokens_and_logprobs(ranks):
    one, two = ranks
    batched = [two.generate(PROMPTS, GREEDY, use_tqdm=False), one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    _compare(batched[1], batched[0])
    assert two.engine.counters["preemptions"] > 0 and one.engine.counters["preemptions"] > 0
    assert two.engine.counters["overlapped_steps"] > 0   # async scheduling: rank 1 read rank 0's sampled tokens
    for prompt in PROMPTS[2:]:   # alone, then again: the second run resumes from the prefix cache
        for _ in range(2):
            _compare(one.generate([prompt], CACHED, use_tqdm=False), two.generate([prompt], CACHED, use_tqdm=False))
    assert two.engine.stats()["prefix_cache_hits"] > 0
    assert two.engine.info.num_state_slots == one.engine.info.num_state_slots
    assert two.engine.info.num_kv_blocks == one.engine.info.num_kv_blocks == 14


def test_ngram_speculation_at_two_ranks():
    spec = dict(ENGINE, async_scheduling=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    repeat = [list(range(10, 30)) * 3]
    one = LLM("nano", **spec).generate(repeat, GREEDY, use_tqdm=False)
    llm = LLM("nano", tensor_parallel_size=2, **spec)
    try:
        two = llm.generate(repeat, GREEDY, use_tqdm=False)
        assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.engine.close()
    _compare(one, two)


@pytest.mark.parametrize("model", ["glm-tiny", "ling-tiny+ep"])
def test_mtp_speculation_at_two_ranks(model):
    """The MTP layer split like the target's (GLM's DSA + MoE; Ling-3's gated MLA + MoE, whole
    experts per rank), its passes run by every rank from rank 0's plan: at two ranks the drafts
    made after each step are one rank's (three per verify, through chunked prefill and
    preemption), and so are the tokens and log-probs."""
    from tests.models.family_parity import drafts_after_each_step

    name, _, ep = model.partition("+")
    kw = dict(ENGINE, async_scheduling=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    one = LLM(name, **kw)
    want = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    want_drafts = drafts_after_each_step(one, PROMPTS[2], 12)
    llm = LLM(name, tensor_parallel_size=2, enable_expert_parallel=ep == "ep", **kw)
    try:
        _compare(want, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert llm.engine.counters["preemptions"] > 0
        made = drafts_after_each_step(llm, PROMPTS[2], 12)
        assert made == want_drafts and len(made[0]) >= 4 and all(len(d) == 3 for _, d in made[0])
        for key in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens"):   # (random weights: few accepted)
            assert llm.engine.stats()[key] == one.engine.stats()[key], key
        assert one.engine.stats()["spec_decode_num_drafts"] > 0
    finally:
        llm.engine.close()


def test_a_vocabulary_the_ranks_cannot_split_is_named():
    """The embedding and LM head split by vocabulary rows: 263 ids over two ranks is refused with
    the sizes that work (check_ranks asks the same before any rank starts)."""
    from kdaserve.layers.distributed import TensorParallel, building_with
    from kdaserve.layers.embed_head import VocabEmbedding

    message = (r"--tensor-parallel-size 2 does not divide the embedding's and LM head's vocabulary rows \(263\); "
               r"the sizes that do: 1$")
    with building_with(TensorParallel(0, 2)), pytest.raises(ValueError, match=message):
        VocabEmbedding(263, 8)
    with building_with(TensorParallel(1, 2)):
        assert VocabEmbedding(264, 8).vocab_start == 132


@pytest.mark.parametrize("kw, message", [
    (dict(tensor_parallel_size=3), r"--tensor-parallel-size 3 does not divide the model's num_attention_heads \(4\); "
                                   r"the sizes that do: 1, 2, 4"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), r"--enable-expert-parallel: tiny has no routed "
                                                                r"experts to split"),
    (dict(enable_expert_parallel=True), r"--enable-expert-parallel splits the experts over the ranks of "
                                        r"--tensor-parallel-size N"),
])
def test_what_two_ranks_cannot_do_is_refused_before_they_start(kw, message):
    model = "tiny" if "enable_expert_parallel" in kw else "nano"
    with pytest.raises(ValueError, match=message):
        LLM(model, **dict(ENGINE, async_scheduling=False), **kw)
    import torch.distributed as dist

    assert not dist.is_initialized()   # no group was made, no rank started


def test_one_split_engine_per_process_at_a_time():
    """torch.distributed has one default group per process: a second split engine while one runs
    is refused by name (before its ranks start); after close() another may start."""
    first = LLM("nano", tensor_parallel_size=2, **dict(ENGINE, async_scheduling=False))
    try:
        with pytest.raises(ValueError, match=r"another tensor-parallel engine runs in this process: close it "
                                             r"\(LLMEngine.close\(\)\) first"):
            LLM("nano", tensor_parallel_size=2, **dict(ENGINE, async_scheduling=False))
        assert len(first.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].output_token_ids) == 32
    finally:
        first.engine.close()
    second = LLM("nano", tensor_parallel_size=2, **dict(ENGINE, async_scheduling=False))
    second.engine.close()


def test_a_rank_that_dies_ends_the_engine_within_seconds_naming_it():
    script = ("import os, sys, time\n"
              "from kdaserve.engine import LLM\n"
              "if __name__ == '__main__':\n"
              "    llm = LLM('nano', device='cpu', max_model_len=64, tensor_parallel_size=2)\n"
              "    print(llm.engine.ranks.processes[0].pid, flush=True)\n"
              "    time.sleep(120)\n")
    path = ROOT / "out" / "tp_rank_dies.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        rank_pid = int(proc.stdout.readline())
        t0 = time.monotonic()
        os.kill(rank_pid, signal.SIGKILL)
        rc = proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10 and rc == 1
        assert "kdaserve-tp-rank-1 exited (exit code -9); the engine stops" in proc.stderr.read()
    finally:
        proc.kill()
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_a_rank_reads_only_its_slices_of_sharded_weights(monkeypatch, ep):
    """Built as rank 1 of 2 from the shipped nano checkpoint: every sharded weight (KDA's q/k/v/b,
    f_b/g_b, convs and o_proj; MLA's q, kv_b and o_proj; the experts' and MLPs' widths) is read half,
    every weight ranks keep whole (norms, router, latent and gate-input projections) whole (the
    embedding and LM head: half, by vocabulary rows), and nothing twice. With expert parallelism
    the routed experts of rank 0 (0..3 of 8) are never read and rank 1's own (4..7) whole."""
    import re

    from safetensors import safe_open

    from kdaserve.layers.distributed import TensorParallel, building_with
    from kdaserve.models.builtin import SHIPPED_CHECKPOINTS
    from kdaserve.models.checkpoint_tensor import CheckpointTensor
    from kdaserve.models.loader import load_model

    reads: dict[str, int] = {}
    real_read = CheckpointTensor._read
    monkeypatch.setattr(CheckpointTensor, "_read", lambda self, index: reads.__setitem__(
        self.name, reads.get(self.name, 0) + 1) or real_read(self, index))
    read_bytes: dict[str, int] = {}
    real = CheckpointTensor.__init__

    def counting(self, handle, name, on_read=None):
        real(self, handle, name, lambda n, b: read_bytes.__setitem__(n, read_bytes.get(n, 0) + b))

    monkeypatch.setattr(CheckpointTensor, "__init__", counting)
    with building_with(TensorParallel(rank=1, size=2, expert_parallel=ep)):
        load_model("nano", dtype=torch.float32, device="cpu")
    with safe_open(str(Path(SHIPPED_CHECKPOINTS["nano"]) / "model.safetensors"), "pt") as f:
        full = {n: f.get_slice(n)[:].numel() * f.get_slice(n)[:].element_size() for n in f.keys()}
    expert = {n: int(m[1]) for n in full if (m := re.search(r"\.experts\.(\d+)\.", n))}
    others = {n for n, e in expert.items() if ep and e < 4}
    assert set(read_bytes) == set(full) - others and max(reads.values()) == 1   # each read once, or never
    whole = ("norm", "gate.", "kv_a_proj", "f_a_proj", "g_a_proj", "A_log", "dt_bias")
    for name, n in full.items():
        if name in others:
            continue
        want = n if any(w in name for w in whole) or (ep and name in expert) else n // 2
        assert read_bytes[name] == want, (name, read_bytes[name], n)
    assert sum(read_bytes.values()) < 0.6 * sum(full.values())


def test_an_fp8_block_a_rank_would_split_is_named():
    """FP8 weights need whole 128-row blocks on every rank: --quantization fp8 at a -tp that splits
    one names each rank's widths and the -tp."""
    from kdaserve.layers.distributed import TensorParallel, building_with
    from kdaserve.models.builtin import builtin_config
    from kdaserve.models.kimi_linear import FP8_LAYOUT

    config = builtin_config("kimi-tiny")
    with building_with(TensorParallel(0, 2)), pytest.raises(
            ValueError, match=r"the MLP widths \(64, 16\) must be multiples of the 128-row block \(each rank's share of "
                              r"\(128, 32\) at --tensor-parallel-size 2\)"):
        FP8_LAYOUT.blocks(config, torch.device("cpu"), "fp8", say=False)
    # MLP widths whole, but the attention's query rows (4 heads x 32) and o_proj's columns (4 x 16)
    # split a block: the heads' widths named, with the sizes that work (one rank's may end short).
    config = dataclasses.replace(config, intermediate_size=256, moe_intermediate_size=256)
    with building_with(TensorParallel(0, 2)), pytest.raises(
            ValueError, match=r"FP8 attention projections need each rank's share of the heads' widths \(128, 64\) in "
                              r"whole 128 x 128 blocks; at --tensor-parallel-size 2 a rank holds \(64, 32\); the sizes "
                              r"that keep whole blocks: 1 \(or leave --quantization unset\)"):
        FP8_LAYOUT.blocks(config, torch.device("cpu"), "fp8", say=False)
    with building_with(TensorParallel(0, 1)):
        assert FP8_LAYOUT.blocks(config, torch.device("cpu"), "fp8", say=False) == ((128, 128), (128, 128))


def test_4bit_experts_split_over_two_ranks():
    """NVFP4 experts (random weights quantized at load, --quantization compressed-tensors): each rank
    keeps its share of every expert's width in 4 bits (packed codes, scales and per-row divisors
    sliced by rows or columns, or whole experts with expert parallelism); two ranks give one rank's
    tokens. MXFP4's groups of 32 do not divide a 16-wide share: the width on the rank is named."""
    from kdaserve.layers.distributed import TensorParallel, building_with
    from kdaserve.layers.moe import MoEMLP
    from kdaserve.ops.moe import RouterConfig

    kw = dict(ENGINE, async_scheduling=False, quantization="compressed-tensors")
    one = LLM("glm-tiny", **kw)
    assert one.engine.runner.model.model.layers[3].mlp.fp4_group == 16
    want = one.generate(PROMPTS[:2], CACHED, use_tqdm=False)
    for ep in (False, True):   # each expert's width split, then whole 4-bit experts per rank
        llm = LLM("glm-tiny", tensor_parallel_size=2, enable_expert_parallel=ep, **kw)
        try:
            _compare(want, llm.generate(PROMPTS[:2], CACHED, use_tqdm=False))
        finally:
            llm.engine.close()
    with building_with(TensorParallel(0, 2)), pytest.raises(
            ValueError, match=r"expert width \(16 on this rank\) and the hidden size \(64\) to be multiples of 32"):
        MoEMLP(64, RouterConfig(4, 2), 32, fp4="mxfp4")


def test_images_at_two_ranks():
    """glm-tiny with images at two ranks (the vision tower whole on each, the step's images sent
    with the step, every rank's encoder cache kept alike): one rank's tokens and log-probs, alone
    with text prompts in a batch and with chunked prefill cutting through the images (48-token steps)."""
    import numpy as np
    from PIL import Image

    images = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (h, w, 3), dtype=np.uint8))
              for s, (h, w) in enumerate(((120, 90), (60, 200)))]
    prompt = {"prompt": "<|user|>\nCompare <|begin_of_image|><|image|><|end_of_image|> with "
                        "<|begin_of_image|><|image|><|end_of_image|>\n<|assistant|>\n",
              "multi_modal_data": {"image": images}}
    kw = dict(ENGINE, num_kv_blocks=40, max_model_len=400)
    batch = [prompt, PROMPTS[1], prompt]   # the same images twice (n > 1's case: one encoding)
    want = LLM("glm-tiny", **kw).generate(batch, GREEDY, use_tqdm=False)
    assert want[0].num_prompt_tokens > 48   # the images' tokens cross a 48-token step
    llm = LLM("glm-tiny", tensor_parallel_size=2, **kw)
    try:
        _compare(want, llm.generate(batch, GREEDY, use_tqdm=False))
    finally:
        llm.engine.close()


def test_a_released_glm_checkpoint_loads_split_from_slices(tmp_path):
    """GLM-5.3-Flash's loader (DSA indexer, hyper-connections, experts by released name) reading
    its rank's slices of a checkpoint directory: two ranks give one rank's greedy tokens."""
    import json

    from safetensors.torch import save_file

    from kdaserve.models.builtin import builtin_config
    from kdaserve.models.glm5_next import random_released_tensors
    from kdaserve.models.tokenizer import ByteTokenizer

    config = builtin_config("glm-tiny")
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "model_type": "glm5_next"}))
    save_file({k: v.contiguous() for k, v in random_released_tensors(config, 3, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text(ByteTokenizer().to_tokenizers_json())
    kw = dict(ENGINE, async_scheduling=False)
    one = LLM(str(tmp_path), **kw).generate(PROMPTS[:2], CACHED, use_tqdm=False)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **kw)
    try:
        _compare(one, llm.generate(PROMPTS[:2], CACHED, use_tqdm=False))
    finally:
        llm.engine.close()


def test_structured_output_at_two_ranks():
    """Grammars run on rank 0 alone (masks at sampling): the split engine's constrained outputs
    are one rank's, and match the constraint."""
    pytest.importorskip("xgrammar")
    import re

    from kdaserve.engine.structured_output.params import StructuredOutputsParams

    def params():
        return SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-f]{3}-[0-9]{4}"))

    kw = dict(ENGINE, async_scheduling=False)
    one = LLM("nano", **kw).generate([[5, 6, 7]], params(), use_tqdm=False)[0].output_token_ids
    llm = LLM("nano", tensor_parallel_size=2, **kw)
    try:
        out = llm.generate([[5, 6, 7]], params(), use_tqdm=False)[0]
    finally:
        llm.engine.close()
    assert out.output_token_ids == one and re.fullmatch(r"[a-f]{3}-[0-9]{4}", out.text), out.text


def test_more_ranks_than_gpus_is_refused_with_how_many_there_are(monkeypatch):
    from kdaserve.engine.config import EngineConfig
    from kdaserve.engine.tensor_parallel import check_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(model="nano", device="cuda", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 needs 4 GPUs from cuda, but this machine has 2; "
                                         r"give at most -tp 2 \(CUDA_VISIBLE_DEVICES picks which\)"):
        check_ranks(config)
    check_ranks(EngineConfig(model="nano", device="cuda", tensor_parallel_size=2))   # two fit
