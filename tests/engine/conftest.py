import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_cpu_thread():
    """The tiny model's ops are microseconds: torch's thread pool only adds contention on a
    shared 2-core machine (measured 5x slower with 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
