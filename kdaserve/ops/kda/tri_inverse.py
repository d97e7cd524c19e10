"""(I + A)^-1 of a strictly lower-triangular tile in registers: the chunk inverse of the WY form
in the `flash` prepare kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(A, N: tl.constexpr, LOG2N: tl.constexpr, PREC: tl.constexpr, OPDT: tl.constexpr = tl.float32):
    """(I + A)^-1 for strictly lower A [N, N] by recursive 2x2 blocking: with T_b the inverse of the
    b-diagonal blocks, T_2b = T_b - T_b A_off T_b, A_off being A's lower-left b-blocks inside each
    2b-block ((T_b A_off)^2 = 0 makes this exact). Every product is of entries of the final inverse
    and of A, both bounded: no cancellation (unlike a doubling product of powers of A, whose
    entries grow combinatorially when keys are correlated), so the dots may run at tf32 (the
    numerics are argued in docs/flash-prefill.md). No memory round trip,
    no barrier: LOG2N - 1 levels of two dependent [N, N] dots. OPDT: the dots' operand type (fp16
    has tf32's 10-bit mantissa, so the same rounding where the entries fit its range, in half the
    registers and tensor-core instructions); accumulation and the result in fp32."""
    r = tl.arange(0, N)
    ri = r[:, None]
    ci = r[None, :]
    T = tl.where(ri == ci, 1.0, 0.0) - tl.where(ri // 2 == ci // 2, A, 0.0)  # b = 1
    for lvl in tl.static_range(1, LOG2N):
        b = 1 << lvl
        off = tl.where((ri // (2 * b) == ci // (2 * b)) & (ri // b != ci // b), A, 0.0)
        t = T.to(OPDT)
        T = T - tl.dot(tl.dot(t, off.to(OPDT), input_precision=PREC).to(OPDT), t, input_precision=PREC)
    return T
