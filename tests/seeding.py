"""The seed of every test: a fixed base seed (KDASERVE_TEST_SEED) mixed with the test's id, so one
commit gives one verdict and a test's draws do not depend on which tests ran before it."""

import os
import zlib

import pytest

SEED_VARIABLE = "KDASERVE_TEST_SEED"
DEFAULT_BASE_SEED = 0


def base_seed() -> int:
    raw = os.environ.get(SEED_VARIABLE, str(DEFAULT_BASE_SEED))
    try:
        return int(raw)
    except ValueError:
        raise pytest.UsageError(f"{SEED_VARIABLE} must be an integer, got {raw!r}") from None


def seed_for(nodeid: str, base: int) -> int:
    """A 31-bit seed from the base and the test id (crc32: stable across processes and Python
    versions, unlike hash())."""
    return (base * 1_000_003 + zlib.crc32(nodeid.encode())) % (2**31 - 1)
