"""What the `chunk` prefill backend needs beyond the registry's defaults (read by the registry
without importing the op package or Triton)."""

from kdaserve.backends import requirements as rq

REQUIREMENTS = [
    # K = V = D in one tile per program: D = 256 would need a [256, 256] state block per output
    # program (128 KB of shared memory), which no Hopper config fits.
    rq.head_dim_power_of_two(16, 128),
    rq.gates("bounded", "unbounded"),
    # The bounded gate's diagonal sub-blocks are anchored assuming |gk| <= 5 (see intra.py).
    rq.lower_bound_range(-5.0, 0.0),
]
