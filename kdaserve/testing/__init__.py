"""Helpers reused by tests, benchmarks and `kdaserve parity`: random-but-valid KDA inputs,
NaN poisoning and relative-RMS comparison with the tolerances of docs/kda-semantics.md section 5."""

from kdaserve.testing.compare import (
    TOLERANCES,
    assert_rel_close,
    assert_slots_untouched,
    max_abs,
    nan_poison,
    rel_rms,
    tolerance_for,
)
from kdaserve.testing.inputs import KDACase, make_kda_case

__all__ = [
    "KDACase",
    "TOLERANCES",
    "assert_rel_close",
    "assert_slots_untouched",
    "make_kda_case",
    "max_abs",
    "nan_poison",
    "rel_rms",
    "tolerance_for",
]
