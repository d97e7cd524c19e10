"""Per-step outputs cost O(1) in the output length (snapshots of append-only lists, no copies)
and still read as the request was at their step, however late they are read."""

import pytest

from kdaserve.engine import LLMEngine, RequestOutput, SamplingParams
from kdaserve.engine.outputs import ListPrefix


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine("tiny", max_num_seqs=4, max_model_len=128, kda_prefill_backend="reference",
                     kda_decode_backend="reference", warmup=False)


def test_outputs_read_late_show_their_own_step(engine):
    prompt = list(b"Snapshots of a stream")
    engine.add_request("s", prompt, SamplingParams(max_tokens=9, ignore_eos=True, logprobs=1, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()           # none of them read until the request is done
    final = outs[-1]
    assert final.finished and len(final.output_token_ids) == 9
    seen = 0
    for o in outs:
        seen += len(o.new_token_ids)
        assert o.num_output_tokens == seen
        assert o.output_token_ids == final.output_token_ids[:seen]
        assert len(o.logprobs) == seen and [e["token_id"] for e in o.logprobs] == o.output_token_ids
        assert o.prompt_logprobs == final.prompt_logprobs[: len(o.prompt_logprobs)]
        assert o.prompt_token_ids == prompt
    assert seen == 9


def test_outputs_share_a_metrics_dict_only_while_it_is_unchanged(engine):
    """OutputProcessor._metrics hands one dict to a request's outputs until a time is added or a count
    changes (the output wire sends it only when new): a later change makes a new dict and never
    reaches the outputs before it."""
    engine.add_request("m", list(b"Metrics"), SamplingParams(max_tokens=6, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    first, *middle, final = outs
    assert "first_token_time" in first.metrics and "finish_time" not in first.metrics
    assert all(o.metrics is first.metrics for o in middle)
    assert "finish_time" in final.metrics and final.metrics is not first.metrics
    assert "finish_time" not in first.metrics and set(final.metrics) - set(first.metrics) == {"finish_time"}


def test_a_step_copies_no_list_of_everything_so_far(engine, monkeypatch):
    seqs = []
    real_add = type(engine.scheduler).add

    def add(self, seq):
        seqs.append(seq)
        real_add(self, seq)

    monkeypatch.setattr(type(engine.scheduler), "add", add)
    passed = []
    engine.add_request("c", [65, 66, 67], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))
    seq = seqs[0]
    real_detok = seq.detokenizer.add
    monkeypatch.setattr(seq.detokenizer, "add", lambda ids, **kw: passed.append(ids) or real_detok(ids, **kw))
    engine.output.incremental_text = True
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert passed and all(ids is seq.token_ids for ids in passed)      # bounds, not a slice
    for o in outs:                                                     # snapshots until read
        assert type(o._output_token_ids) is ListPrefix and type(o._logprobs) is ListPrefix
    assert outs[-1].output_token_ids == seq.token_ids[3:] and type(outs[-1]._output_token_ids) is list


def test_request_output_compares_and_prints_by_value():
    a = RequestOutput("r", [1], ListPrefix([1, 5, 6], 1), [6], "x", True, "length", num_output_tokens=2)
    b = RequestOutput("r", [1], [5, 6], [6], "x", True, "length", num_output_tokens=2)
    assert a == b and "output_token_ids=[5, 6]" in repr(a)
    b.output_token_ids = [5]
    assert a != b
