"""A device this machine cannot run on is a one-line error that says why and what can, for every
command (the engine and `parity` check the device through usable_device)."""

import pytest
import torch

from kdaserve.backends import usable_device
from kdaserve.engine import LLMEngine


def test_the_default_and_the_cpu():
    assert usable_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert usable_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_cuda_without_a_gpu_says_why(monkeypatch):
    with pytest.raises(ValueError, match=r"--device cuda: this torch \(.*\) was built without CUDA or ROCm; use "
                                         r"--device cpu") if torch.version.cuda is None else \
            pytest.raises(ValueError, match="no GPU is visible"):
        usable_device("cuda")
    with pytest.raises(ValueError, match="--device cuda"):
        LLMEngine("tiny", device="cuda")


def test_unknown_devices_say_what_is_allowed():
    with pytest.raises(ValueError, match="'gpu' is not a device torch knows .*; use cpu or cuda"):
        usable_device("gpu")
    with pytest.raises(ValueError, match="kdaserve runs on cpu or cuda"):
        usable_device("mps")


def test_parity_and_generate_print_the_line_not_a_traceback(capsys):
    from kdaserve.cli import main

    assert main(["parity", "--device", "gpu"]) == 2
    assert "kdaserve parity: --device 'gpu' is not a device torch knows" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--device", "gpu", "--prompt", "x"]) == 2
    assert "kdaserve generate: --device 'gpu'" in capsys.readouterr().err
