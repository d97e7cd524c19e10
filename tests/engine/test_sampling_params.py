import pytest

from kdaserve.engine import SamplingParams


def test_defaults_are_greedy():
    p = SamplingParams()
    assert p.greedy and p.max_tokens == 16 and p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_stop_string_becomes_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**64), "seed"),           # torch.Generator.manual_seed would raise inside a step
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_invalid_values_say_what_and_what_is_expected(kwargs, field):
    with pytest.raises(ValueError, match=rf"{field}: got .*; expected "):
        SamplingParams(**kwargs)
