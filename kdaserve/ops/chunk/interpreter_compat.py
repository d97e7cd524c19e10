"""Lets Triton 3.6's interpreter run a loop whose bound is a loaded value (CPU tests only).

The state pass walks a sequence's chunks with `for ic in range(num_chunks)`, `num_chunks` read from
cu_seqlens on the device. The interpreter holds scalars as shape-(1,) numpy arrays and converts them
with `int(array)`, which numpy >= 2.4 refuses. The fix converts through the first element; it is
the same patch as kdaserve.ops.flash.interpreter_compat (the shared marker makes installing both a
no-op) and touches nothing when kernels are compiled.
"""

from __future__ import annotations

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
