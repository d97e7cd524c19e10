"""Decode step of one KDA layer (conv update -> recurrence -> gated RMSNorm), under CUDA-graph replay.

Columns, side by side in one run on the same inputs and pools:
  fused  kdaserve.ops.kda.fused.kda_decode_fused: one launch
  chain  kdaserve.ops.kda.chain.kda_decode_chain: three launches (skipped when missing)
  adaptive  kdaserve.ops.kda.adaptive.kda_decode_adaptive: fused for plain decode (verify: fused up to 512 head-steps)
         (the `auto` choice on CUDA; should equal the faster of the two columns)
  fla    FLA 0.6.0 fused_recurrent_kda (paged, in-place, V-first state) with our conv update and
         gated norm before and after it, plus the copy that splits the conv output into the
         contiguous q, k, v FLA reads (FLA also gets a contiguous copy of the beta logits made
         outside the timed region). Skipped when fla is not installed.

How it is timed, and why:
- Each graph holds R calls of the same step on R disjoint sets of slots, like R layers of a model
  graph back to back; time per call = replay time / R. R shrinks as the state grows (R = 1 from
  ~300 MB of state per call), so launch gaps are amortized at small N and nothing is cached
  between calls; do_bench also flushes L2 before every replay.
- Effective bandwidth counts the state traffic only: 2 * N * H * D * D * bytes (read + write).
  The copy ceiling of the H200 is ~4.27 TB/s.

Sections (each row is printed as soon as it is measured, so a cut-off run still tells something):
  sweep   fused launch shapes at H=32 next to chain (fp32 and bf16 state): what default_config's
          rule is derived from
  table   default fused vs chain vs FLA at 16/32/64 heads, N = 1..512, fp32 and bf16 state
  verify  speculative verify (S=3) at H=32, fused shapes vs chain
  gate    the default fused launch with the unbounded gate (Kimi-Linear's) against the bounded one,
          H=32, N = 1, 8, 64, 512, both state dtypes, same inputs
  goals   issue 4's goals, each PASS/MISS

Run (H200, < 2.5 min):  PYTHONPATH=$PWD python benchmarks/bench_decode.py
The stream shapes against the split shapes and chain only (< 3 min):
  PYTHONPATH=$PWD python benchmarks/bench_decode.py --sections sweep table --shapes stream "bv64 w4" "bv8 w1" \
      --sweep-batches 8 64 128 512 --heads 32 --batches 1 8 64 128 256 512
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton
import triton.testing

from kdaserve.ops.kda.fused import FusedDecodeConfig, fused_conv_weight_layout, launch_fused_decode
from kdaserve.ops.kda.fused.decode import STREAM_SHAPES
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs
from kdaserve.testing.compare import rel_rms
from kdaserve.testing.inputs import make_kda_weights

D = 128
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SWEEP = {  # fused launch shapes: "whole" = one program per head; "bvX wY" = D/X programs of Y warps per
    # head meeting through an arrival counter; "+sf": state stored before the arrival
    "whole w8": FusedDecodeConfig(None, 8),
    "bv64 w4": FusedDecodeConfig(64, 4),
    "bv32 w4": FusedDecodeConfig(32, 4),
    "bv32 w4+sf": FusedDecodeConfig(32, 4, store_first=True),
    "bv16 w4": FusedDecodeConfig(16, 4),
    "bv8 w1": FusedDecodeConfig(8, 1),
    "bv4 w1": FusedDecodeConfig(4, 1),
    # "stream ...": one program per head streaming [bvX, K] tiles (stream_kernel.py, plain decode
    # only), for the bandwidth-bound steps (docs/fused-decode.md); the table says what sZ/pfN mean.
    **STREAM_SHAPES,
}
SWEEP_BATCHES = {torch.float32: (1, 2, 4, 8, 16, 32, 64, 128, 512), torch.bfloat16: (1, 8, 64, 512)}
VERIFY = {"default": None, "whole w8": FusedDecodeConfig(None, 8), "bv32 w4": FusedDecodeConfig(32, 4),
          "bv16 w4": FusedDecodeConfig(16, 4), "bv8 w1": FusedDecodeConfig(8, 1)}


class Step:
    """One decode step's inputs for N sequences and pools holding R disjoint slot sets."""

    def __init__(self, H: int, N: int, R: int, state_dtype: torch.dtype, seed: int = 0, dev: str = "cuda",
                 spec: int = 0, gate: str = "bounded"):
        """spec = S > 0: a speculative verify step of S+1 tokens per sequence, S+1 state slots each."""
        g = torch.Generator(device=dev).manual_seed(seed)
        P = H * D
        self.H, self.N, self.R, self.S1 = H, N, R, spec + 1
        N, T = N * self.S1, N * self.S1  # slots per replica, tokens
        self.weights = make_kda_weights(H, D, gate=gate, device=dev, generator=torch.Generator().manual_seed(seed))
        self.weights.conv_weight_decode = fused_conv_weight_layout(self.weights.conv_weight)
        self.proj = torch.randn(N, 3 * P + H + 2 * D, device=dev, generator=g).to(torch.bfloat16)
        self.qkv, self.beta = self.proj[:, : 3 * P], self.proj[:, 3 * P : 3 * P + H]
        self.forget_logits = torch.randn(N, H, D, device=dev, generator=g).to(torch.bfloat16)
        self.output_gate_logits = torch.randn(N, H, D, device=dev, generator=g).to(torch.bfloat16)
        slots = 1 + R * N
        self.conv_state = torch.randn(slots, 3 + spec, 3 * P, device=dev, generator=g).to(torch.bfloat16)
        self.state = (torch.randn(slots, H, D, D, device=dev, generator=g) * 0.2).to(state_dtype)
        perm = (torch.randperm(R * N, device=dev, generator=g) + 1).to(torch.int32)
        self.spec = list(perm.view(R, self.N, self.S1))  # verify: each sequence's S+1 slots
        self.indices = [x[:, -1].contiguous() for x in self.spec] if spec else list(perm.view(R, N))
        self.accepted = torch.randint(1, self.S1 + 1, (self.N,), device=dev, generator=g, dtype=torch.int32)
        self.out = torch.empty(T, H, D, device=dev, dtype=torch.bfloat16)

    def args(self, r: int) -> dict:
        """A decode entry point's arguments for the r-th set of slots (built once per graph capture)."""
        spec = (self.spec[r], self.accepted) if self.S1 > 1 else (None, None)
        return dict(inputs=KDAInputs(self.qkv, self.forget_logits, self.beta, self.output_gate_logits), weights=self.weights,
                    cache=KDACache(self.conv_state, self.state), seqs=DecodeSeqs(self.indices[r], *spec), out=self.out)

    def state_bytes(self) -> int:
        """Bytes that must move: each state read once, written once per token slot."""
        return (1 + self.S1) * self.N * self.H * D * D * self.state.element_size()


def fused_impl(config=None):
    return lambda step, r: launch_fused_decode(config, **step.args(r))


def chain_impl():
    try:
        from kdaserve.ops.kda.chain import kda_decode_chain
    except ImportError:
        return None
    return lambda step, r: kda_decode_chain(**step.args(r))


def adaptive_impl():
    """The `adaptive` backend: fused for plain decode; verify fused up to 512 head-steps (kdaserve/ops/kda/adaptive.py)."""
    try:
        from kdaserve.ops.kda.adaptive import kda_decode_adaptive
    except ImportError:
        return None
    return lambda step, r: kda_decode_adaptive(**step.args(r))


def fla_impl():
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    from kdaserve.ops.kda.conv import causal_conv_update_fwd
    from kdaserve.ops.norm import gated_rms_norm_fwd

    def run(step, r):
        N, H, w = step.N, step.H, step.weights
        if not hasattr(step, "fla_bufs"):  # allocated once, outside capture: FLA wants contiguous q, k, v, beta
            dev = step.qkv.device
            step.fla_bufs = (torch.empty(N, 3 * H * D, device=dev), torch.empty(3, N, 1, H, D, device=dev),
                             torch.empty(N, 1, H, D, device=dev), step.beta.contiguous().view(N, 1, H))
        y, qkv3, o, beta = step.fla_bufs
        idx = step.indices[r]
        causal_conv_update_fwd(step.qkv, w.conv_weight, step.conv_state, idx, None, "SD", out=y)
        qkv3.copy_(y.view(N, 3, 1, H, D).transpose(0, 1))
        fused_recurrent_kda_fwd(
            q=qkv3[0], k=qkv3[1], v=qkv3[2], g=step.forget_logits.view(N, 1, H, D), beta=beta, A_log=w.A_log,
            dt_bias=w.dt_bias, scale=D**-0.5, initial_state=step.state, inplace_final_state=True,
            state_v_first=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=w.lower_bound, out=o,
        )
        gated_rms_norm_fwd(o.view(N, H, D), step.output_gate_logits, w.norm_weight, w.norm_eps, step.out, row_state_indices=idx)

    return run


def time_per_call(impl, step: Step) -> float:
    """Median microseconds per call: R calls captured in one graph, replayed (NaN if it fails:
    one broken column must not lose the rest of a GPU run)."""
    try:
        return _time_per_call(impl, step)
    except Exception as e:  # noqa: BLE001 - reported, then the table goes on
        print(f"  FAILED at H={step.H} N={step.N} {step.state.dtype}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def _time_per_call(impl, step: Step) -> float:
    impl(step, 0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(step.R):
            impl(step, r)
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=20, return_mode="median")
    del graph
    return ms * 1e3 / step.R


def replicas(N: int, H: int, state_dtype: torch.dtype) -> int:
    per_call = N * H * D * D * torch.empty((), dtype=state_dtype).element_size()
    return max(1, min(32, math.ceil(300e6 / per_call)))


def agreement(impls: dict, H: int, N: int = 8, dev: str = "cuda") -> str:
    """The columns compute the same step: outputs and states vs chain (else the first column) on
    identical pools; every fused launch shape of the sweep is included."""
    res = {}
    for name, impl in impls.items():
        s = Step(H, N, 1, torch.float32, seed=1, dev=dev)
        impl(s, 0)
        res[name] = s
    base = "chain" if "chain" in res else next(iter(res))
    b = res.pop(base)
    parts = [f"{n}: out {rel_rms(s.out.float(), b.out.float()):.1e}, state {rel_rms(s.state, b.state):.1e}, "
             f"conv {'same' if torch.equal(s.conv_state, b.conv_state) else 'DIFFERS'}" for n, s in res.items()]
    return f"agreement with {base} at H={H}, N={N} (rel RMS): " + "; ".join(parts)


def cell(us: float, nbytes: int) -> str:
    return f"{us:.1f} ({nbytes / us / 1e6:.2f})"


def run_sweep(chain, t0: float, shapes=None, batches=None) -> list:
    """Fused launch shapes next to chain at H=32; rows printed as measured. `shapes`: only the
    SWEEP names containing one of these strings; `batches`: only these N (both state dtypes)."""
    sweep = {k: c for k, c in SWEEP.items() if not shapes or any(x in k for x in shapes)}
    names = list(sweep) + (["chain"] if chain else [])
    print("\nfused launch shapes, H=32: us per call (TB/s); best marked *", flush=True)
    print("| state | N | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names), flush=True)
    rows = []
    for state_dtype, default_batches in SWEEP_BATCHES.items():
        for N in batches or default_batches:
            step = Step(32, N, replicas(N, 32, state_dtype), state_dtype)
            t = {k: time_per_call(fused_impl(c), step) for k, c in sweep.items()}
            if chain:
                t["chain"] = time_per_call(chain, step)
            best = min(sweep, key=lambda k: t[k] if t[k] == t[k] else math.inf)
            cells = [cell(t[k], step.state_bytes()) + ("*" if k == best else "") for k in names]
            print(f"| {str(state_dtype)[6:]} | {N} | " + " | ".join(cells) + " |", flush=True)
            rows.append((state_dtype, N, t, step.state_bytes()))
            del step
            torch.cuda.empty_cache()
    print(f"  sweep done ({time.time() - t0:.0f} s)", flush=True)
    return rows


def run_verify(chain, t0: float, S: int = 3) -> None:
    """Speculative verify (S+1 tokens per sequence) at H=32, fp32 state: fused shapes vs chain.
    TB/s counts one state read and S+1 state writes."""
    names = list(VERIFY) + (["chain"] if chain else [])
    print(f"\nspeculative verify S={S}, H=32, fp32 state: us per call (TB/s)", flush=True)
    print("| N | " + " | ".join(names) + " |\n|---|" + "---|" * len(names), flush=True)
    for N in (1, 8, 64):
        step = Step(32, N, replicas(N * (S + 1), 32, torch.float32), torch.float32, spec=S)
        t = {k: time_per_call(fused_impl(c), step) for k, c in VERIFY.items()}
        if chain:
            t["chain"] = time_per_call(chain, step)
        print(f"| {N} | " + " | ".join(cell(t[k], step.state_bytes()) for k in names) + " |", flush=True)
        del step
        torch.cuda.empty_cache()
    print(f"  verify done ({time.time() - t0:.0f} s)", flush=True)


def run_gate(t0: float) -> None:
    """The default fused launch, unbounded gate vs bounded, at H=32 on the same inputs and pools."""
    print("\nfused decode, unbounded gate vs bounded, H=32: us per call (TB/s of state traffic)", flush=True)
    print("| state | N | bounded | unbounded | unbounded / bounded |\n|---|---|---|---|---|", flush=True)
    for state_dtype in (torch.float32, torch.bfloat16):
        for N in (1, 8, 64, 512):
            t = {}
            for gate in ("bounded", "unbounded"):
                step = Step(32, N, replicas(N, 32, state_dtype), state_dtype, gate=gate)
                t[gate] = time_per_call(fused_impl(), step)
                nbytes = step.state_bytes()
                del step
                torch.cuda.empty_cache()
            print(f"| {str(state_dtype)[6:]} | {N} | {cell(t['bounded'], nbytes)} | {cell(t['unbounded'], nbytes)} | "
                  f"{t['unbounded'] / t['bounded']:.3f}x |", flush=True)
    print(f"  gate done ({time.time() - t0:.0f} s)", flush=True)


def run_table(impls: dict, heads, batches, t0: float) -> list:
    names = list(impls)
    head = "| state | H | N | " + " | ".join(names) + (" | fused vs chain |" if "chain" in impls else " |")
    print(f"\ndecode step per layer under CUDA-graph replay, D={D}: us per call (TB/s of state traffic)", flush=True)
    print(head + "\n|" + "---|" * (head.count("|") - 1), flush=True)
    rows = []  # (state dtype, H, N, {impl: us}, bytes)
    for state_dtype in (torch.float32, torch.bfloat16):
        for H in heads:
            for N in batches:
                step = Step(H, N, replicas(N, H, state_dtype), state_dtype)
                t = {name: time_per_call(impl, step) for name, impl in impls.items()}
                rows.append((state_dtype, H, N, t, step.state_bytes()))
                print(table_row(rows[-1], names, "chain" in impls), flush=True)
                del step
                torch.cuda.empty_cache()
    print(f"  table done ({time.time() - t0:.0f} s)", flush=True)
    return rows


def table_row(row, names, have_chain: bool) -> str:
    sd, H, N, t, b = row
    ratio = [f"{t['chain'] / t['fused']:.2f}x"] if have_chain else []
    return f"| {str(sd)[6:]} | {H} | {N} | " + " | ".join([cell(t[k], b) for k in names] + ratio) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[32, 16, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="sweep only the fused shapes whose name contains one of these (e.g. stream 'bv64 w4')")
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=None,
                    help="sweep only these N (default: fp32 1..512, bf16 1, 8, 64, 512)")
    ap.add_argument("--sections", nargs="+", default=["sweep", "table", "verify"], choices=["sweep", "table", "verify", "gate"])
    args = ap.parse_args()
    t0 = time.time()
    impls = {"fused": fused_impl(), "chain": chain_impl(), "adaptive": adaptive_impl(), "fla": fla_impl()}
    impls = {k: v for k, v in impls.items() if v is not None}
    print(torch.cuda.get_device_name(), "| columns:", ", ".join(impls), flush=True)
    try:
        shapes = {f"fused {k}": fused_impl(c) for k, c in SWEEP.items()
                  if not args.shapes or any(x in k for x in args.shapes)}
        print(agreement({**impls, **shapes}, 32), flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"agreement check FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)

    if "sweep" in args.sections:
        run_sweep(impls.get("chain"), t0, args.shapes, args.sweep_batches)
    rows = run_table(impls, args.heads, args.batches, t0) if "table" in args.sections else []
    if "verify" in args.sections:
        run_verify(impls.get("chain"), t0)
    if "gate" in args.sections:
        run_gate(t0)
    if rows:  # the table again, whole, last
        names = list(impls)
        print(f"\ndecode step per layer under CUDA-graph replay, D={D}: us per call (TB/s of state traffic); "
              f"{torch.cuda.get_device_name()}; total {time.time() - t0:.0f} s")
        head = "| state | H | N | " + " | ".join(names) + (" | fused vs chain |" if "chain" in impls else " |")
        print(head + "\n|" + "---|" * (head.count("|") - 1))
        for r in rows:
            print(table_row(r, names, "chain" in impls))
        goals(rows, "chain" in impls)


def goals(rows, have_chain: bool) -> None:
    fp32 = [r for r in rows if r[0] == torch.float32]
    bw = [(H, N, b / t["fused"] / 1e6) for _, H, N, t, b in fp32 if N * H >= 2048]

    def verdict(ok: list) -> str:
        return "n/a" if not ok else ("PASS" if all(ok) else "MISS")

    print("\ngoals (fp32 state unless said):")
    print("  >= 3.2 TB/s where N*H >= 2048:", verdict([x >= 3.2 for *_, x in bw]),
          " ".join(f"H{H}/N{N}={x:.2f}" for H, N, x in bw if x < 3.2))
    for sd in (torch.float32, torch.bfloat16):  # floor: the state bytes at the 4.27 TB/s copy ceiling
        lat = [(N, t["fused"], b / 4.27e6) for d, H, N, t, b in rows if d == sd and H == 32 and N <= 8]
        print(f"  <= 6 us at N <= 8, 32 heads, {str(sd)[6:]} state (judged where the floor allows):",
              verdict([t <= 6 for _, t, f in lat if f <= 6]),
              " ".join(f"N{N}={t:.1f}us(floor {f:.1f})" for N, t, f in lat))
    if have_chain:
        sp = [(H, N, t["chain"] / t["fused"]) for _, H, N, t, _ in fp32 if N <= 32]
        print("  >= 1.5x vs chain at N <= 32:", verdict([x >= 1.5 for *_, x in sp]),
              " ".join(f"H{H}/N{N}={x:.2f}x" for H, N, x in sp if x < 1.5))
        slower = [(sd, H, N) for sd, H, N, t, _ in rows if min(v for k, v in t.items() if k != "adaptive") < t["fused"]]
        print("  fused the fastest column everywhere (both state dtypes):", verdict([not slower]),
              " ".join(f"{str(sd)[6:]}/H{H}/N{N}" for sd, H, N in slower))
        if any("adaptive" in t for *_, t, _ in rows):
            worse = [(sd, H, N, t["adaptive"] / min(t["fused"], t["chain"])) for sd, H, N, t, _ in rows
                     if t["adaptive"] > 1.03 * min(t["fused"], t["chain"])]
            print("  adaptive within 3% of the faster of fused and chain:", verdict([not worse]),
                  " ".join(f"{str(sd)[6:]}/H{H}/N{N}={x:.2f}x" for sd, H, N, x in worse))


if __name__ == "__main__":
    main()
