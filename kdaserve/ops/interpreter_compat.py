"""Lets Triton 3.6's interpreter run loops whose bound is a tensor (CPU tests only).

The interpreter holds every scalar as a shape-(1,) numpy array and turns it into a Python int with
`int(array)`, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"). So
`for c in range(n)` with a loaded or computed `n` fails there, while it compiles fine for GPUs.
This wraps the interpreter's tensor patching to convert through the first element. Installed when
TRITON_INTERPRET is on; it changes nothing for compiled kernels.
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
