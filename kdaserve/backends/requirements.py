"""What a backend needs, and the facts it is checked against.

A backend declares a list of `Requirement`s. Each one looks at two things:

- the `Machine` the layer runs on (platform, GPU architecture, installed packages, Triton's
  interpreter switch), probed once without importing any optional package;
- the `LayerSettings` it is asked to run (input dtype, head size, gate kind, recurrent-state
  dtype, conv layout, speculative tokens).

`unmet()` returns a sentence saying what is needed and what is there instead, so a resolution
error can list every unmet requirement at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from kdaserve.ops.kda.types import CONV_LAYOUTS

PLATFORMS = ("cuda", "rocm", "cpu")
_SHORT = {"cuda": "CUDA", "rocm": "ROCm", "cpu": "CPU"}

# Distribution names to ask importlib.metadata for a module's version (module name otherwise).
_DISTRIBUTIONS = {
    "fla": ("fla-core", "flash-linear-attention"),
    "flash_kda": ("flash-kda", "flash_kda"),
    "aiter": ("amd-aiter", "aiter"),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_version(text: str) -> tuple[int, ...]:
    """'0.6.0.dev1+g12' -> (0, 6, 0): enough to compare release numbers."""
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def _probe_module(name: str) -> str | None:
    """The version of an installed module ("" when unknown), None when absent; imports nothing.

    A dotted name is looked up as a file under its top-level package, so probing
    `aiter.ops.triton.attention.kda` does not run aiter's (heavy) package imports.
    """
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if rest:
        roots = list(spec.submodule_search_locations or [])
        if not any(
            os.path.isfile(os.path.join(root, *rest) + ".py") or os.path.isfile(os.path.join(root, *rest, "__init__.py"))
            for root in roots
        ):
            return None
    for dist in _DISTRIBUTIONS.get(top, (top,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def parse_device(device: torch.device | str | None = None) -> torch.device:
    """`device` as torch's (default: the first GPU if any, else the CPU); ValueError for a name
    torch does not know. Whether this machine can run on it: usable_device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"--device {device!r} is not a device torch knows ({exc}); use cpu or cuda[:N]") from None


def usable_device(device: torch.device | str | None = None) -> torch.device:
    """parse_device's device, or a ValueError saying why this machine cannot run on it and what
    can: asked for a GPU, torch's own assertion says only "Torch not compiled with CUDA enabled",
    deep inside the first tensor it moves."""
    device = parse_device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"this torch ({torch.__version__}) was built without CUDA or ROCm" if torch.version.cuda is None
                   and torch.version.hip is None else "no GPU is visible to torch (CUDA_VISIBLE_DEVICES, driver)")
            raise ValueError(f"--device {device}: {why}; use --device cpu, or a torch build for your GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s) "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif device.type not in ("cpu", "meta"):   # meta: shapes without memory (capacity and layer-kind tools)
        raise ValueError(f"--device {device}: kdaserve runs on cpu or cuda (ROCm GPUs are cuda to torch)")
    return device


@dataclass
class Machine:
    """Where a layer runs. `modules=None` probes this Python (cached); a dict fixes the answers
    (module -> version, "" for unknown version) so tests can describe any machine."""

    platform: str                                  # "cuda", "rocm" or "cpu": the layer's device
    cuda_capability: tuple[int, int] | None = None  # (9, 0) on H100/H200
    rocm_arch: str | None = None                   # "gfx950" on MI355X
    triton_interpret: bool = False                 # TRITON_INTERPRET=1: Triton kernels on CPU tensors
    modules: dict[str, str] | None = None
    _probed: dict[str, str | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> "Machine":
        """The machine as seen from `device` (default: the first GPU if any, else the CPU)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if device.type != "cuda":
            return cls("cpu", triton_interpret=interpret)
        props = torch.cuda.get_device_properties(device)
        if torch.version.hip:
            arch = (getattr(props, "gcnArchName", "") or "").split(":")[0] or None
            return cls("rocm", rocm_arch=arch, triton_interpret=interpret)
        return cls("cuda", cuda_capability=(props.major, props.minor), triton_interpret=interpret)

    def module_version(self, name: str) -> str | None:
        if self.modules is not None:
            return self.modules.get(name)
        if name not in self._probed:
            self._probed[name] = _probe_module(name)
        return self._probed[name]

    def describe_platform(self) -> str:
        if self.platform == "cuda":
            cap = f" sm_{self.cuda_capability[0]}{self.cuda_capability[1]}" if self.cuda_capability else ""
            return f"CUDA{cap}"
        if self.platform == "rocm":
            return f"ROCm {self.rocm_arch or '(unknown arch)'}"
        return "CPU" + (" with TRITON_INTERPRET=1" if self.triton_interpret else " without TRITON_INTERPRET=1")


@dataclass(frozen=True)
class LayerSettings:
    """What the layer asks a backend to run. `lower_bound=None` is the unbounded (softplus) gate."""

    input_dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    lower_bound: float | None = -5.0
    state_dtype: torch.dtype = torch.float32
    conv_layout: str = "SD"
    num_spec_tokens: int = 0
    conv_width: int = 4
    round_gate: bool = False   # gk rounded to the activation dtype (Ling-3; KDAWeights.round_gate)

    @property
    def gate(self) -> str:
        return "unbounded" if self.lower_bound is None else "bounded"

    @classmethod
    def defaults_for(cls, machine: Machine) -> "LayerSettings":
        """The default layer of `kdaserve info`: bf16 on a GPU, fp32 on the CPU, head 128,
        bounded gate, fp32 state, SD conv layout, no speculation."""
        return cls(input_dtype=torch.float32 if machine.platform == "cpu" else torch.bfloat16)


Check = Callable[[Machine, LayerSettings], str | None]


@dataclass(frozen=True)
class Requirement:
    """One condition a backend needs. `check` returns None when met, else what is there instead."""

    kind: str          # platform, arch, package, dtype, head_dim, gate, state_dtype, conv_layout, speculative, ...
    needs: str         # human words: "input dtype bfloat16 or float16"
    check: Check

    def unmet(self, machine: Machine, settings: LayerSettings) -> str | None:
        have = self.check(machine, settings)
        return None if have is None else f"needs {self.needs}; {have}"


def unmet_requirements(reqs: Iterable[Requirement], machine: Machine, settings: LayerSettings) -> list[str]:
    """Every unmet requirement, in declaration order (all of them are evaluated)."""
    return [msg for r in reqs if (msg := r.unmet(machine, settings)) is not None]


# ---- builders -------------------------------------------------------------------------------


def platform(*allowed: str, triton_interpreter: bool = False) -> Requirement:
    """Runs on these platforms; with `triton_interpreter`, also on the CPU when TRITON_INTERPRET=1."""
    names = {"cuda": "CUDA", "rocm": "ROCm", "cpu": "CPU"}
    words = " or ".join(names[p] for p in allowed)
    if triton_interpreter and "cpu" not in allowed:
        words += ", or CPU with TRITON_INTERPRET=1 (Triton's interpreter)"

    def check(m: Machine, s: LayerSettings) -> str | None:
        if m.platform in allowed or (triton_interpreter and m.platform == "cpu" and m.triton_interpret):
            return None
        return f"this layer runs on {m.describe_platform()}"

    return Requirement("platform", f"platform {words}", check)


def min_cuda_capability(major: int, minor: int = 0) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        if m.platform != "cuda":
            return f"the layer does not run on a CUDA GPU ({_SHORT[m.platform]})"
        if m.cuda_capability is None or m.cuda_capability < (major, minor):
            return f"this GPU is {m.describe_platform()}"
        return None

    return Requirement("arch", f"an NVIDIA GPU of compute capability >= {major}.{minor} (sm_{major}{minor}+)", check)


def rocm_arch(*archs: str) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        if m.platform != "rocm":
            return f"the layer does not run on a ROCm GPU ({_SHORT[m.platform]})"
        return None if m.rocm_arch in archs else f"this GPU is {m.rocm_arch or 'of unknown arch'}"

    return Requirement("arch", f"an AMD GPU of architecture {' or '.join(archs)}", check)


def package(module: str, min_version: str | None = None, *, hint: str = "") -> Requirement:
    """An installed module (probed without importing it), optionally of a minimum version."""
    needs = f"package `{module}`" + (f" >= {min_version}" if min_version else "") + (f" ({hint})" if hint else "")

    def check(m: Machine, s: LayerSettings) -> str | None:
        version = m.module_version(module)
        if version is None:
            return "it is not installed"
        if min_version and version and parse_version(version) < parse_version(min_version):
            return f"version {version} is installed"
        return None

    return Requirement("package", needs, check)


def entry_points(*modules: str, hint: str = "") -> Requirement:
    """Submodules an external package must ship (its KDA entry points), found without importing."""
    needs = "the entry point module" + ("s " if len(modules) > 1 else " ") + ", ".join(f"`{x}`" for x in modules)
    needs += f" ({hint})" if hint else ""

    def check(m: Machine, s: LayerSettings) -> str | None:
        missing = [x for x in modules if m.module_version(x) is None]
        return None if not missing else f"missing: {', '.join(missing)}"

    return Requirement("package", needs, check)


def implementation(module: str) -> Requirement:
    """The kdaserve module that implements a backend is present in this install."""

    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if m.module_version(module) is not None else "it is not part of this kdaserve install"

    return Requirement("implementation", f"its implementation `{module}`", check)


def input_dtypes(*dtypes: torch.dtype) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if s.input_dtype in dtypes else f"the layer's inputs are {dtype_name(s.input_dtype)}"

    return Requirement("dtype", "input dtype " + " or ".join(dtype_name(d) for d in dtypes), check)


def no_bf16_in_interpreter() -> Requirement:
    """Triton 3.6's interpreter returns garbage for tl.dot on bf16 operands."""

    def check(m: Machine, s: LayerSettings) -> str | None:
        if m.platform == "cpu" and s.input_dtype == torch.bfloat16:
            return "bf16 inputs on the CPU would run tl.dot in Triton's interpreter, which is wrong for bf16"
        return None

    return Requirement("dtype", "non-bf16 inputs when run by Triton's CPU interpreter", check)


def head_dims(*sizes: int) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if s.head_dim in sizes else f"the head size is {s.head_dim}"

    return Requirement("head_dim", "head size " + " or ".join(map(str, sizes)), check)


def head_dim_power_of_two(lo: int, hi: int) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        d = s.head_dim
        return None if lo <= d <= hi and d & (d - 1) == 0 else f"the head size is {d}"

    return Requirement("head_dim", f"a head size that is a power of two in [{lo}, {hi}]", check)


def gates(*kinds: str) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if s.gate in kinds else f"the layer's gate is {s.gate}"

    words = {"bounded": "the bounded (lower_bound) gate", "unbounded": "the unbounded (softplus) gate"}
    return Requirement("gate", " or ".join(words[k] for k in kinds), check)


def unrounded_gate() -> Requirement:
    """An external kernel computes the gate itself, in fp32: it cannot round it as Ling-3 does."""
    def check(m: Machine, s: LayerSettings) -> str | None:
        return "the layer rounds its gate to the activation dtype (Ling-3)" if s.round_gate else None

    return Requirement("gate", "a gate kept in fp32 (not rounded to the activation dtype)", check)


def lower_bound_range(lo: float, hi: float) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        lb = s.lower_bound
        return None if lb is None or lo <= lb < hi else f"lower_bound is {lb}"

    return Requirement("gate", f"lower_bound in [{lo}, {hi})", check)


def state_dtypes(*dtypes: torch.dtype) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if s.state_dtype in dtypes else f"the recurrent state is {dtype_name(s.state_dtype)}"

    return Requirement("state_dtype", "recurrent-state dtype " + " or ".join(dtype_name(d) for d in dtypes), check)


def conv_layouts(*layouts: str) -> Requirement:
    for layout in layouts:
        if layout not in CONV_LAYOUTS:
            raise ValueError(f"unknown conv layout {layout!r}")

    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if s.conv_layout in layouts else f"the conv state layout is {s.conv_layout}"

    return Requirement("conv_layout", "conv-state layout " + " or ".join(layouts), check)


def conv_widths(*widths: int) -> Requirement:
    def check(m: Machine, s: LayerSettings) -> str | None:
        return None if s.conv_width in widths else f"the conv width is {s.conv_width}"

    return Requirement("conv_width", "conv width " + " or ".join(map(str, widths)), check)


def speculative(supported: bool) -> Requirement:
    """Whether the backend runs with speculative decoding on (S > 0: verify steps, W-1+S conv rows)."""

    def check(m: Machine, s: LayerSettings) -> str | None:
        if s.num_spec_tokens and not supported:
            return f"speculative decoding is on ({s.num_spec_tokens} draft tokens)"
        return None

    return Requirement("speculative", "speculative decoding off" if not supported else "nothing (speculative ok)", check)
