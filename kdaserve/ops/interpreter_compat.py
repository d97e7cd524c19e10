"""Lets Triton 3.6's interpreter run loops whose bound is a tensor (CPU tests only).

The interpreter holds every scalar as a shape-(1,) numpy array and turns it into a Python int with
`int(array)`, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"). So
`for c in range(n)` with a loaded or computed `n` fails there, while it compiles fine for GPUs.
This wraps the interpreter's tensor patching to convert through the first element.

Its float -> FP8 conversion also rounds wrongly where rounding carries into the exponent (31.6
becomes 16, not 32): float8_e4m3fn and float8_e5m2 downcasts go through torch's conversion
(round to nearest even, as the GPU does). Installed when TRITON_INTERPRET is on; it changes
nothing for compiled kernels.
"""

from __future__ import annotations

import numpy as np
import torch
import triton


def install() -> None:
    if not triton.knobs.runtime.interpret:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_kdaserve_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kdaserve_index_fix = True
    interpreter._patch_lang_tensor = patched
    _install_fp8_rounding(interpreter)


def _install_fp8_rounding(interpreter) -> None:
    import triton.language as tl

    original = interpreter._convert_float
    if getattr(original, "_kdaserve_fp8_fix", False):
        return
    targets = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    sources = {tl.float32: np.float32, tl.float16: np.float16}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype in targets and input_dtype in sources:
            values = torch.from_numpy(np.ascontiguousarray(input).view(sources[input_dtype]).astype(np.float32))
            return values.to(targets[output_dtype]).view(torch.uint8).numpy().reshape(input.shape)
        if output_dtype in targets and input_dtype == tl.bfloat16:
            wide = original(input, input_dtype, tl.float32, None)
            return convert(wide, tl.float32, output_dtype, rounding_mode)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert._kdaserve_fp8_fix = True
    interpreter._convert_float = convert
