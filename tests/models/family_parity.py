"""What the model families' tests share when they check kdaserve against transformers (Kimi-Linear,
GLM-5.3-Flash, Ling-3): full log-prob rows of every prompt position, transformers' greedy tokens,
the engine's greedy tokens alone, batched, chunked and preempted, and the MTP drafts made step by
step."""

from __future__ import annotations

import torch

from kdaserve.engine import LLM, SamplingParams


def dense_row(entry: dict, vocab: int) -> torch.Tensor:
    """A log-prob entry's top list as a [vocab] row (NaN where an id is missing)."""
    row = torch.full((vocab,), float("nan"))
    for i, v in entry["top"]:
        row[i] = v
    return row


def logprob_rows(llm, prompts, vocab: int) -> list[torch.Tensor]:
    """Per prompt, [len(prompt), vocab]: the log-probs of every position after the first, then of
    the first generated token (the engine built with max_logprobs=vocab)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=vocab, logprobs=vocab, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [torch.stack([dense_row(e, vocab) for e in o.prompt_logprobs[1:]] + [dense_row(o.logprobs[0], vocab)])
            for o in outs]


def hf_logprobs(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].log_softmax(-1)


def hf_greedy(hf, prompt, n: int = 32) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_greedy_alone_batched_chunked_preempted(model: str, prompts, want, engine_kw: dict, *,
                                                 tight_max_model_len: int = 80) -> None:
    """32 greedy tokens of every prompt equal `want` alone, batched, in prefill chunks of at most 8
    tokens, and with a 9-block pool of 16 that forces preemptions (every slot and block given back)."""
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)

    def ids(llm, batch):
        return [o.output_token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]

    llm = LLM(model, max_model_len=256, **engine_kw)
    assert [ids(llm, [p])[0] for p in prompts] == want                         # alone
    assert ids(llm, prompts) == want                                           # batched
    chunked = LLM(model, max_model_len=256, max_num_batched_tokens=8, **engine_kw)
    assert ids(chunked, prompts) == want                                       # prompts cut into chunks of <= 8 tokens
    tight = LLM(model, max_model_len=tight_max_model_len, num_kv_blocks=9, block_size=16, **engine_kw)
    assert ids(tight, prompts) == want
    assert tight.engine.counters["preemptions"] > 0
    stats = tight.engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0


def drafts_after_each_step(llm, prompt, n: int):
    """Greedy-generate n tokens one engine step at a time; every draft the MTP layer made, as (the
    sequence's length it continues, the draft), and the final tokens."""
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    made, tokens = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.prompt_token_ids + out.output_token_ids
        for seq_len, drafts in list(engine.proposer._drafts.values()):
            made.append((seq_len, list(drafts)))
    return made, tokens
