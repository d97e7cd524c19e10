import importlib.util
import os
import random

import numpy as np
import pytest
import torch
from seeding import SEED_VARIABLE, base_seed, seed_for

# Without a GPU, Triton kernels can only run through the interpreter: set it before any test
# module imports a kernel (the README's test command sets it too; this keeps `pytest` alone working).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The server tests need the `serve` extra; a machine without it (the GPU box) skips the folder
# instead of failing on its conftest's imports.
collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")) else ["server"]


def pytest_report_header(config):
    return f"kdaserve test seed: {SEED_VARIABLE}={base_seed()} (per test: crc32 of its id mixed in)"


@pytest.fixture(autouse=True)
def _seed_every_rng(request):
    seed = seed_for(request.node.nodeid, base_seed())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"reproduce with: {SEED_VARIABLE}={base_seed()} python -m pytest '{item.nodeid}'"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
