"""Paired statistics for A/B evidence (scipy): McNemar's exact test on paired pass/fail outcomes,
a paired mean difference with its standard error and 95% interval, and a difference judged real
only when it clears the noise an A/A pair shows."""

from __future__ import annotations

import math
from dataclasses import dataclass


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: under "no difference" the discordant pairs split 50/50,
    so it is the two-sided binomial test of min(only_a, only_b) in only_a + only_b trials."""
    from scipy.stats import binomtest

    n = only_a + only_b
    if n == 0:
        return 1.0
    return float(binomtest(min(only_a, only_b), n, 0.5).pvalue)


@dataclass
class PairedDifference:
    n: int
    mean: float          # mean of b - a
    se: float            # its standard error
    low: float           # 95% interval (t distribution)
    high: float

    def clears(self, noise: "PairedDifference | None" = None) -> bool:
        """Real: the 95% interval excludes 0 and, with an A/A `noise` estimate, |mean| is larger
        than the A/A pair's |mean| plus the half-widths of both intervals."""
        if not (self.low > 0 or self.high < 0):
            return False
        if noise is None:
            return True
        return abs(self.mean) > abs(noise.mean) + (noise.high - noise.low) / 2 + (self.high - self.low) / 2


def paired_difference(a: list[float], b: list[float]) -> PairedDifference:
    from scipy.stats import t

    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples need the same non-zero length; got {len(a)} and {len(b)}")
    d = [y - x for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    if n == 1:
        return PairedDifference(1, mean, math.inf, -math.inf, math.inf)
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    se = math.sqrt(var / n)
    half = float(t.ppf(0.975, n - 1)) * se
    return PairedDifference(n, mean, se, mean - half, mean + half)


def distribution(values: list[float]) -> dict:
    """Mean, max and quantiles of `values` (absolute differences, say)."""
    if not values:
        return {"n": 0}
    s = sorted(values)

    def q(p):
        return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]

    return {"n": len(s), "mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}
