"""`kdaserve parity`: check KDA backends against the fp64 reference and each other on this machine.

Examples:
  kdaserve parity                                   # every backend that can run here, small shapes
  kdaserve parity --prefill-backends reference,chunk,flash,fla --decode-backends chain,fused,fla \\
      --heads 32 --head-dim 128 --lengths 131072 --decode-steps 256
  TRITON_INTERPRET=1 kdaserve parity --device cpu --decode-backends reference,chain,fused
Exits 1 when a comparison is past its tolerance, 2 when a backend cannot run here.
"""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("parity", help="compare KDA backends against the fp64 reference and each other",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-backends", help="comma-separated names (default: every prefill backend that can run here)")
    p.add_argument("--decode-backends", help="comma-separated names (default: every decode backend that can run here)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--heads", type=int, help="KDA heads (default: 32 on a GPU, 2 on the CPU)")
    p.add_argument("--head-dim", type=int, help="head size (default: 128 on a GPU, 32 on the CPU)")
    p.add_argument("--hidden", type=int, help="hidden size of the projections (default: 2048 on a GPU, 64 on the CPU)")
    p.add_argument("--gate", choices=("bounded", "unbounded"), default="bounded",
                   help="the forget gate: bounded (GLM-5.3-Flash, Ling-3) or unbounded (Kimi-Linear) (default: bounded)")
    p.add_argument("--lower-bound", type=float, default=-5.0, help="bounded gate's lower bound, in [-5, 0)")
    p.add_argument("--slow-decay-heads", type=int, default=0, help="heads whose gates are near 0 (the long-context hard case)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="activation dtype (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32", help="the recurrent state's dtype (default: fp32)")
    p.add_argument("--conv-layout", choices=("SD", "DS"), default="SD", help="the conv state's layout, as vLLM's (default: SD)")
    p.add_argument("--lengths", help="prefill lengths, e.g. 8192,1024x16 (default: 8192,1024x16 on a GPU, 40,7x3 on the CPU)")
    p.add_argument("--decode-steps", type=int, help="decode steps after the prefill (default: 64 on a GPU, 4 on the CPU)")
    p.add_argument("--mixed-chunk", type=int, default=37, help="prefill tokens per sequence in the mixed step")
    p.add_argument("--spec-tokens", type=int, default=0, help="S draft tokens: adds two speculative verify steps")
    p.add_argument("--tolerance", type=float,
                   help="relative RMS limit against the reference (default: docs/kda-semantics.md section 5)")
    p.add_argument("--seed", type=int, default=0, help="the random inputs' seed (default: 0)")
    p.set_defaults(func=run)


def build_config(args):
    import torch

    from kdaserve.backends import LayerSettings, Machine, describe_backends, usable_device
    from kdaserve.evidence.parity import DTYPES, ParityConfig, parse_lengths

    device = str(usable_device(args.device))
    gpu = torch.device(device).type == "cuda"

    def pick(value, on_gpu, on_cpu):
        return value if value is not None else (on_gpu if gpu else on_cpu)

    heads, head_dim = pick(args.heads, 32, 2), pick(args.head_dim, 128, 32)
    dtype = DTYPES[pick(args.dtype, "bf16", "fp32")]
    state_dtype = DTYPES[args.state_dtype]
    lower_bound = args.lower_bound if args.gate == "bounded" else None

    def names(text, phase):
        if text:
            return [n.strip() for n in text.split(",") if n.strip()]
        settings = LayerSettings(input_dtype=dtype, head_dim=head_dim, lower_bound=lower_bound, state_dtype=state_dtype,
                                 conv_layout=args.conv_layout, num_spec_tokens=args.spec_tokens)
        return [r["name"] for r in describe_backends(Machine.detect(device), settings) if r["phase"] == phase and r["runnable"]]

    return ParityConfig(
        prefill_backends=names(args.prefill_backends, "prefill"), decode_backends=names(args.decode_backends, "decode"),
        heads=heads, head_dim=head_dim, hidden=pick(args.hidden, 2048, 64), gate=args.gate, lower_bound=args.lower_bound,
        slow_decay_heads=args.slow_decay_heads, dtype=dtype, state_dtype=state_dtype, conv_layout=args.conv_layout,
        lengths=parse_lengths(pick(args.lengths, "8192,1024x16", "40,7x3")), decode_steps=pick(args.decode_steps, 64, 4),
        mixed_chunk=args.mixed_chunk, spec_tokens=args.spec_tokens, device=device, seed=args.seed, tolerance=args.tolerance,
    )


def run(args) -> int:
    from kdaserve.backends import BackendError
    from kdaserve.evidence.parity import run_parity

    try:
        cfg = build_config(args)
        print(f"parity on {cfg.device}: {cfg.heads} heads x {cfg.head_dim}, {cfg.gate} gate, {str(cfg.dtype)[6:]} inputs, "
              f"{str(cfg.state_dtype)[6:]} state, {cfg.conv_layout} conv layout; prefill {','.join(cfg.prefill_backends)}; "
              f"decode {','.join(cfg.decode_backends)}")
        return run_parity(cfg)
    except (BackendError, ValueError) as err:
        print(f"kdaserve parity: {err}", file=sys.stderr)
        return 2
