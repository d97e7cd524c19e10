"""How much accuracy a bf16 recurrent state costs over long decodes, against fp64 ground truth.

Three copies of the same layer decode the same 1024 steps of fresh random bf16 inputs:
  fp64  the torch reference (kda_decode_reference) with fp64 state and math: ground truth;
  fp32  the fused kernel with the default fp32 state;
  bf16  the fused kernel with the opt-in bf16 state (rounded after every step).
All start from the same bf16-representable state. Outputs are stored in fp32 so the error shown is
the state's, not the output cast's. A quarter of the heads decay slowly (gates near 0): their
state remembers longest, so rounding errors accumulate most there. Both gate kinds are run.

Printed: relative RMS error vs fp64 of the step's output and of the state, over all heads and over
the slow heads only, at growing step counts; the contract's bound for a bf16 state is 2e-2.

Run (H200, ~15 s):  PYTHONPATH=$PWD python benchmarks/accuracy_bf16_state.py
"""

from __future__ import annotations

import argparse
import time

import torch

from kdaserve.ops.kda.fused import fused_conv_weight_layout, kda_decode_fused
from kdaserve.ops.kda.reference import kda_decode_reference
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs
from kdaserve.testing.compare import TOLERANCES, rel_rms
from kdaserve.testing.inputs import make_kda_weights

D = 128


def checkpoints(steps: int) -> list[int]:
    marks, s = [], 1
    while s < steps:
        marks.append(s)
        s *= 2
    return sorted(set(marks + [1000, steps]) & set(range(1, steps + 1)))


def run(gate: str, steps: int, N: int, H: int, seed: int = 0, dev: str = "cuda") -> list[tuple]:
    g = torch.Generator(device=dev).manual_seed(seed)
    P = H * D
    slow = slice(H - H // 4, H)
    w = make_kda_weights(H, D, gate=gate, slow_decay_heads=H // 4, device=dev, generator=torch.Generator().manual_seed(seed))
    w.conv_weight_decode = fused_conv_weight_layout(w.conv_weight)
    state0 = (torch.randn(N + 1, H, D, D, device=dev, generator=g) * 0.2).to(torch.bfloat16)
    conv0 = torch.randn(N + 1, 3, 3 * P, device=dev, generator=g).to(torch.bfloat16)
    pools = {
        "fp64": (conv0.double(), state0.double()),
        "fp32": (conv0.clone(), state0.float()),
        "bf16": (conv0.clone(), state0.clone()),
    }
    idx = torch.arange(1, N + 1, device=dev, dtype=torch.int32)
    marks, rows = set(checkpoints(steps)), []
    for step in range(1, steps + 1):
        proj = torch.randn(N, 3 * P + H, device=dev, generator=g)
        proj[:, 3 * P :] *= 2.0
        proj = proj.to(torch.bfloat16)
        forget_logits = torch.randn(N, H, D, device=dev, generator=g).to(torch.bfloat16)
        output_gate_logits = torch.randn(N, H, D, device=dev, generator=g).to(torch.bfloat16)
        outs = {}
        for name, (conv, state) in pools.items():
            x = proj.double() if name == "fp64" else proj
            out = torch.empty(N, H, D, device=dev, dtype=torch.float64 if name == "fp64" else torch.float32)
            fn = kda_decode_reference if name == "fp64" else kda_decode_fused
            inputs = KDAInputs(x[:, : 3 * P], forget_logits.double() if name == "fp64" else forget_logits, x[:, 3 * P :],
                               output_gate_logits.double() if name == "fp64" else output_gate_logits)
            fn(inputs, w, KDACache(conv, state), DecodeSeqs(idx), out)
            outs[name] = out
        if step in marks:
            ref_out, ref_state = outs["fp64"], pools["fp64"][1][1:]
            row = [step]
            for name in ("fp32", "bf16"):
                o, s = outs[name], pools[name][1][1:]
                row += [rel_rms(o, ref_out), rel_rms(s, ref_state),
                        rel_rms(o[:, slow], ref_out[:, slow]), rel_rms(s[:, slow], ref_state[:, slow])]
            rows.append(tuple(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    t0 = time.time()
    tables = {gate: run(gate, args.steps, args.sequences, args.heads) for gate in ("bounded", "unbounded")}
    bound = TOLERANCES["bf16_state"]
    print(f"{torch.cuda.get_device_name()}: {args.sequences} sequences x {args.heads} heads (a quarter slow-decay), "
          f"D={D}, bf16 inputs, fresh random inputs every step; {time.time() - t0:.0f} s")
    for gate, rows in tables.items():
        print(f"\n{gate} gate: relative RMS error vs the fp64 reference (bf16-state bound {bound:g})")
        print("| step | fp32 out | fp32 state | fp32 out, slow heads | fp32 state, slow heads "
              "| bf16 out | bf16 state | bf16 out, slow heads | bf16 state, slow heads |")
        print("|---:|" + "---:|" * 8)
        for r in rows:
            print(f"| {r[0]} | " + " | ".join(f"{e:.2e}" for e in r[1:]) + " |")
        worst = max(max(r[5:]) for r in rows)
        print(f"worst bf16-state error over {args.steps} steps: {worst:.2e} "
              f"({'within' if worst < bound else 'OVER'} the {bound:g} bound)")


if __name__ == "__main__":
    main()
