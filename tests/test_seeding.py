"""The autouse seeding of tests/conftest.py: a test's draws depend only on the base seed and its id."""

import random

import numpy as np
import pytest
import torch
from seeding import base_seed, seed_for


def test_draws_come_from_the_seed_of_this_test(request):
    drawn = (torch.rand(4), random.random(), float(np.random.rand()))
    seed = seed_for(request.node.nodeid, base_seed())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    assert torch.equal(drawn[0], torch.rand(4)) and drawn[1] == random.random() and drawn[2] == float(np.random.rand())


def test_seeds_differ_by_test_and_by_base():
    a, b = "tests/x.py::test_a", "tests/x.py::test_b"
    assert seed_for(a, 0) != seed_for(b, 0) and seed_for(a, 0) != seed_for(a, 1)
    assert seed_for(a, 3) == seed_for(a, 3) and 0 <= seed_for(a, 2**40) < 2**31


def test_a_base_seed_that_is_no_integer_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KDASERVE_TEST_SEED", "seven")
    with pytest.raises(pytest.UsageError, match="KDASERVE_TEST_SEED must be an integer, got 'seven'"):
        base_seed()
