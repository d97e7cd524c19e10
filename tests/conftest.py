import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels can only run through the interpreter: set it before any test
# module imports a kernel (the README's test command sets it too; this keeps `pytest` alone working).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The server tests need the `serve` extra; a machine without it (the GPU box) skips the folder
# instead of failing on its conftest's imports.
collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")) else ["server"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
