"""The KDA delta-rule recurrence for decode and speculative verify (Triton), in place on the pool."""

from kdaserve.ops.kda.recurrent.decode import kda_recurrent_fwd

__all__ = ["kda_recurrent_fwd"]
