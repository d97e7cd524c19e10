"""The paired statistics on inputs with known answers."""

import random

import pytest

from kdaserve.evidence.stats import distribution, mcnemar_exact, paired_difference


def test_mcnemar_matches_a_hand_computed_case():
    # 1 vs 6 discordant pairs: p = 2 * P(X <= 1 | n = 7, 1/2) = 2 * (1 + 7) / 128 = 0.125
    assert mcnemar_exact(1, 6) == pytest.approx(0.125)
    assert mcnemar_exact(6, 1) == pytest.approx(0.125)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == pytest.approx(1.0)
    assert mcnemar_exact(0, 12) == pytest.approx(2 / 4096)


def test_an_aa_pair_is_not_called_real_and_a_planted_difference_is():
    rng = random.Random(0)
    base = [100 + rng.gauss(0, 5) for _ in range(40)]
    aa = paired_difference(base, [x + rng.gauss(0, 1) for x in base])
    assert not aa.clears(), aa
    shifted = paired_difference(base, [x + 3 + rng.gauss(0, 1) for x in base])
    assert shifted.clears(aa) and shifted.low < 3 < shifted.high, shifted
    small = paired_difference(base, [x + 0.2 + rng.gauss(0, 1) for x in base])
    assert not small.clears(aa), "a shift inside the A/A noise is not real"


def test_distribution_and_bad_input():
    d = distribution([0.0, 1.0, 2.0, 3.0, 4.0])
    assert d["mean"] == 2.0 and d["max"] == 4.0 and d["p50"] == 2.0
    with pytest.raises(ValueError, match="same non-zero length"):
        paired_difference([1.0], [1.0, 2.0])
