"""vLLM's --stream-interval and the request's stream_interval: a request reports its tokens every
N of them (the first token's output and the last at once), the same tokens and text in all, and
an abort reports what was held back."""

import pytest

from kdaserve.engine import LLMEngine, SamplingParams

PROMPT = list(b"Batched streaming of ")


def engine(interval: int = 1) -> LLMEngine:
    return LLMEngine("tiny", max_num_seqs=4, max_model_len=128, kda_prefill_backend="reference",
                     kda_decode_backend="reference", warmup=False, stream_interval=interval)


def run(eng: LLMEngine, params: SamplingParams, rid: str = "r") -> list:
    eng.add_request(rid, PROMPT, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("engine_interval, request_interval, chunks", [
    (1, None, [1] * 11),
    (4, None, [1, 4, 4, 2]),            # the first token at once, then every 4, the rest at the end
    (1, 3, [1, 3, 3, 3, 1]),            # the request's own
    (4, 2, [1, 4, 4, 2]),               # a request cannot lower the engine's
    (1, 20, [1, 10]),                   # longer than the output: first and last only
])
def test_outputs_carry_every_interval_of_tokens_and_the_same_result(engine_interval, request_interval, chunks):
    params = SamplingParams(max_tokens=11, ignore_eos=True, logprobs=1, stream_interval=request_interval)
    outs = run(engine(engine_interval), params)
    plain = run(engine(1), SamplingParams(max_tokens=11, ignore_eos=True, logprobs=1))
    assert [len(o.new_token_ids) for o in outs] == chunks
    assert [t for o in outs for t in o.new_token_ids] == plain[-1].output_token_ids == outs[-1].output_token_ids
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].text == plain[-1].text and outs[-1].logprobs == plain[-1].logprobs
    seen = 0
    for o in outs:   # each output is the request as it was: its text and lists end at its tokens
        seen += len(o.new_token_ids)
        assert o.num_output_tokens == seen == len(o.output_token_ids) == len(o.logprobs)


def test_an_abort_reports_the_tokens_held_back():
    eng = engine(5)
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    outs = []
    while sum(len(o.new_token_ids) for o in outs) + 3 < 9:   # the first token, then some held back
        outs += eng.step()
        held = eng.requests["a"].new_token_ids
        if len(held) == 3:
            break
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        outs += eng.step()
    last = outs[-1]
    assert last.finished and last.finish_reason == "abort" and last.new_token_ids == held
    assert [t for o in outs for t in o.new_token_ids] == last.output_token_ids


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_interval_says_what_is_expected(bad):
    with pytest.raises(ValueError, match=r"invalid stream_interval: got .*; expected None or an integer >= 1"):
        SamplingParams(stream_interval=bad)
    with pytest.raises(ValueError, match=r"invalid stream_interval: got .*; expected an integer >= 1"):
        engine(bad)
