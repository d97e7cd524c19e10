"""Lets Triton 3.6's interpreter run loops whose bound is a tensor (CPU tests only).

The interpreter holds every scalar as a shape-(1,) numpy array and turns it into a Python int with
`int(array)`, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"). So
`for c in range(n)` with a loaded or computed `n` fails there, while it compiles fine for GPUs.
This wraps the interpreter's tensor patching to convert through the first element.

Its float -> FP8 conversion also rounds wrongly where rounding carries into the exponent (31.6
becomes 16, not 32): float8_e4m3fn and float8_e5m2 downcasts go through torch's conversion
(round to nearest even, as the GPU does). And it holds bf16 values as their uint16 bits, then
applies numpy's arithmetic to the bits (a bf16 product is an integer product of two bit
patterns, a bf16 dot an integer matmul; a bf16 scalar constant has no builder method at all):
bf16 arithmetic (fma included) and comparisons go through fp32 here and round once to bf16
(nearest even), as a GPU's bf16 instructions do, and bf16 dot operands enter the fp32 matmul as
their values.
Installed when TRITON_INTERPRET is on; it changes nothing for compiled kernels.
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
    _install_bf16_arithmetic(interpreter)


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


# The interpreter's float binary operations (bf16 operands reach them as uint16 bits).
_FLOAT_BINARY_OPS = ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_precise_divf", "create_frem",
                     "create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf", "create_fcmpOLT",
                     "create_fcmpOGT", "create_fcmpOLE", "create_fcmpOGE", "create_fcmpOEQ", "create_fcmpONE",
                     "create_fcmpUNO", "create_fcmpOrd", "create_fcmpULT", "create_fcmpUGT", "create_fcmpULE",
                     "create_fcmpUGE", "create_fcmpUEQ", "create_fcmpUNE")


def _bf16_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(bits))


def _fp32_to_bf16(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy() \
        .view(np.uint16)


def _install_bf16_arithmetic(interpreter) -> None:
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_kdaserve_bf16_fix", False):
        return
    for name in _FLOAT_BINARY_OPS:
        original = getattr(builder, name, None)
        if original is None:
            continue

        def op(self, lhs, rhs, original=original):
            if lhs.dtype.scalar != tl.bfloat16:
                return original(self, lhs, rhs)
            wide = original(self, interpreter.TensorHandle(_bf16_to_fp32(lhs.data), tl.float32),
                            interpreter.TensorHandle(_bf16_to_fp32(rhs.data), tl.float32))
            if wide.data.dtype == np.bool_:   # a comparison's booleans, labeled as the interpreter labels them
                return interpreter.TensorHandle(wide.data, tl.bfloat16)
            return interpreter.TensorHandle(_fp32_to_bf16(wide.data), tl.bfloat16)   # arithmetic: one rounding

        setattr(builder, name, op)
    original_fma = builder.create_fma

    def fma(self, x, y, z):
        if z.dtype.scalar != tl.bfloat16:
            return original_fma(self, x, y, z)
        wide = original_fma(self, *(interpreter.TensorHandle(_bf16_to_fp32(t.data), tl.float32) for t in (x, y, z)))
        return interpreter.TensorHandle(_fp32_to_bf16(wide.data), tl.bfloat16)

    original_dot = builder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = interpreter.TensorHandle(_bf16_to_fp32(a.data), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = interpreter.TensorHandle(_bf16_to_fp32(b.data), tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_fma = fma
    builder.create_dot = dot
    builder.get_bf16 = lambda self, value: interpreter.TensorHandle(_fp32_to_bf16(np.array([value], dtype=np.float32)),
                                                                    tl.bfloat16)
    builder._kdaserve_bf16_fix = True
