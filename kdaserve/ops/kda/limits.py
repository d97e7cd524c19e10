"""What each Triton KDA op supports, in one place and as plain data (importing only torch):

- the backend registry turns an op's limits into its requirements (startup errors listing every
  unmet one, `kdaserve info`), without importing the op package or Triton;
- each op's entry point checks its inputs against the same values (`OpLimits.check`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# The bounded gate's LB lies in [LOWER_BOUND_MIN, 0): the chunked kernels anchor in-chunk decays
# assuming |gk| <= 5 (docs/kda-semantics.md section 1.4). The reference refuses others too.
LOWER_BOUND_MIN = -5.0


def check_lower_bound(lower_bound: float | None, what: str = "lower_bound") -> None:
    """None is the unbounded gate; anything else must lie in [LOWER_BOUND_MIN, 0)."""
    if lower_bound is not None and not LOWER_BOUND_MIN <= lower_bound < 0.0:
        raise ValueError(f"{what} must lie in [{LOWER_BOUND_MIN:g}, 0) for the bounded gate, or be None for the "
                         f"unbounded gate; got {lower_bound}")


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


@dataclass(frozen=True)
class OpLimits:
    """The inputs an op accepts. `bf16_in_interpreter`: False for ops with bf16 dots, which Triton
    3.6's interpreter computes wrongly (they refuse bf16 inputs there)."""

    name: str
    input_dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    state_dtypes: tuple[torch.dtype, ...] = (F32, BF16)
    gates: tuple[str, ...] = ("bounded", "unbounded")
    conv_layouts: tuple[str, ...] = ("SD", "DS")
    conv_widths: tuple[int, ...] | None = None       # None: any width
    speculative: bool = True
    bf16_in_interpreter: bool = True

    def check(self, *, head_dim: int, lower_bound: float | None, input_dtype: torch.dtype | None = None,
              state_dtype: torch.dtype | None = None, conv_width: int | None = None) -> None:
        """Raise ValueError naming what is wrong and what would be right (metadata only, no sync);
        a None dtype or width is not checked."""
        if input_dtype is not None and input_dtype not in self.input_dtypes:
            raise ValueError(f"{self.name} takes {_names(self.input_dtypes)} inputs, got {_names([input_dtype])}")
        if head_dim not in self.head_dims:
            raise ValueError(f"{self.name} supports head sizes {self.head_dims}, got D = {head_dim}")
        if state_dtype is not None and state_dtype not in self.state_dtypes:
            raise ValueError(f"{self.name} keeps its recurrent state in {_names(self.state_dtypes)}, got {_names([state_dtype])}")
        gate = "unbounded" if lower_bound is None else "bounded"
        if gate not in self.gates:
            raise ValueError(f"{self.name} supports the {' and '.join(self.gates)} gate, got the {gate} one")
        check_lower_bound(lower_bound)
        if conv_width is not None and self.conv_widths is not None and conv_width not in self.conv_widths:
            raise ValueError(f"{self.name} supports conv widths {self.conv_widths}, got W = {conv_width}")


POWERS_OF_TWO_16_TO_128 = (16, 32, 64, 128)

# flash: K = V = D in one tile per program; D = 256 would need a [256, 256] fp32 state block per
# program, which no Hopper config fits in registers or shared memory.
FLASH = OpLimits("flash prefill", (BF16, F16, F32), POWERS_OF_TWO_16_TO_128, bf16_in_interpreter=False)
CHAIN = OpLimits("chain decode", (F32, F16, BF16), POWERS_OF_TWO_16_TO_128 + (256,))
# fused: the width-4 conv window is unrolled in the kernel.
FUSED = OpLimits("fused decode", (F32, F16, BF16), POWERS_OF_TWO_16_TO_128, conv_widths=(4,))

BY_OP = {"flash": FLASH, "chain": CHAIN, "fused": FUSED}
