"""Activations in Triton: SwiGLU on merged gate|up rows."""

from kdaserve.ops.activation.swiglu import swiglu_fwd, swiglu_reference

__all__ = ["swiglu_fwd", "swiglu_reference"]
