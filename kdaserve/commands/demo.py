"""`kdaserve demo`: a reference KDA prefill and decode on a built-in case, checked and timed.

The smallest end-to-end run of the contract: a mixed-length prefill into the paged caches, then
decode steps from the written states, each computed by the fp32 reference (chunked form for the
prefill) and checked against the fp64 token loop.
"""

from __future__ import annotations

import functools
import time


def register(sub) -> None:
    p = sub.add_parser("demo", help="reference KDA prefill + decode on a built-in case, with a short table")
    p.add_argument("--heads", type=int, default=4, help="KDA heads (default: 4)")
    p.add_argument("--head-dim", type=int, default=32, help="head size (default: 32)")
    p.add_argument("--lengths", default="64,17,5", help="prompt lengths, comma separated")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps after the prefill (default: 8)")
    p.add_argument("--gate", choices=["bounded", "unbounded"], default="bounded", help="the forget gate (default: bounded)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from kdaserve.ops.kda.reference import kda_decode_reference, kda_prefill_reference
    from kdaserve.testing import make_kda_case, rel_rms
    from kdaserve.testing.properties import run_decode, run_prefill, to_fp64

    lengths = [int(x) for x in args.lengths.split(",")]
    H, D = args.heads, args.head_dim
    case = make_kda_case(lengths, H=H, D=D, gate=args.gate, has_initial_state=False, seed=0)
    truth = to_fp64(case)
    rows = []

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3

    out, ms = timed(lambda: run_prefill(functools.partial(kda_prefill_reference, chunk_size=16), case))
    ref = run_prefill(kda_prefill_reference, truth, out_dtype=torch.float64)
    rows.append(("prefill (chunked, fp32)", sum(lengths), ms, rel_rms(out, ref),
                 rel_rms(case.recurrent_state, truth.recurrent_state)))

    for step in range(args.decode_steps):
        dcase = make_kda_case([1] * len(lengths), H=H, D=D, weights=case.weights, has_initial_state=True, seed=100 + step)
        # Continue the prefilled sequences: same slots, same pools.
        dcase.state_indices, dcase.conv_state, dcase.recurrent_state = case.state_indices, case.conv_state, case.recurrent_state
        dtruth = to_fp64(dcase)
        dtruth.conv_state, dtruth.recurrent_state = truth.conv_state, truth.recurrent_state
        out, ms = timed(lambda: run_decode(kda_decode_reference, dcase))
        ref = run_decode(kda_decode_reference, dtruth, out_dtype=torch.float64)
        if step in (0, args.decode_steps - 1):
            rows.append((f"decode step {step + 1}", len(lengths), ms, rel_rms(out, ref),
                         rel_rms(case.recurrent_state, truth.recurrent_state)))

    print(f"\nKDA reference demo: {len(lengths)} sequences {lengths}, {H} heads x {D}, {args.gate} gate, fp32 vs fp64 token loop")
    print(f"{'step':<26}{'tokens':>8}{'ms':>10}{'out rel-rms':>14}{'state rel-rms':>15}")
    for name, tokens, ms, e_out, e_state in rows:
        print(f"{name:<26}{tokens:>8}{ms:>10.2f}{e_out:>14.2e}{e_state:>15.2e}")
    worst = max(max(r[3], r[4]) for r in rows)
    ok = worst < 1e-5
    print(f"\n{'PASS' if ok else 'FAIL'}: worst relative error {worst:.2e} (tolerance 1e-5 for fp32)")
    return 0 if ok else 1
