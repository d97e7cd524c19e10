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


@pytest.fixture(autouse=True, scope="package")
def _transformers_on_its_torch_paths():
    """The reference is transformers' pure-torch port, run on the CPU. Where flash-linear-attention
    is installed (the GPU machine) transformers binds its Triton kernels at import instead, and they
    cannot take CPU tensors: put the torch functions they wrap back in place."""
    import importlib
    import inspect

    names = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")
    with pytest.MonkeyPatch.context() as mp:
        for family in ("kimi_linear", "glm5_next", "bailing_hybrid"):
            try:
                module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            except ImportError:
                continue
            for name in names:
                if hasattr(module, name):
                    mp.setattr(module, name, inspect.unwrap(getattr(module, name)))
        yield
