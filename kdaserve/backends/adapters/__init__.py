"""Adapters that put external KDA kernels (flash-linear-attention, FlashKDA, AMD AITER) behind our
calling convention (kdaserve.ops.kda.reference.kda). Each is imported only when its backend is
selected, and imports its external package only when called."""
