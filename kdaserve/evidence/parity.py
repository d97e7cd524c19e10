"""`kdaserve parity`: KDA backends side by side on one layer, the same inputs and the same steps,
judged against the fp64 reference and against each other (docs/kda-semantics.md section 5).

One KDA layer with random (realistically scaled) weights provides the projections; every backend
then runs the layer's step router (kdaserve.layers.kda_routing) on identical core inputs and its own
copy of identical cache pools:

1. prefill: the given sequences (`8192,1024x16`), some resuming from history, in one varlen step;
2. decode: `decode_steps` steps of one token for every sequence plus one padding row (slot 0);
3. mixed: decodes for half of the sequences and prefill chunks for the other half, in one step,
   for every (prefill, decode) pair;
4. speculative (with `spec_tokens` S > 0): two verify steps of S+1 tokens per sequence, the second
   resuming after a random number of accepted drafts.

Each phase starts every backend from the same pools (the reference's, cast to the working dtypes),
so its errors are its own. The ground truth is the torch reference in fp64 (prefill in pieces of
`piece` tokens, which is exact: a split prefill equals the whole). Reported per backend: relative
RMS and max-abs errors of the outputs and of the final recurrent states, whether its conv states
equal the reference's bit for bit, and whether slots outside the batch stayed untouched.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kdaserve.backends import Machine, ResolvedBackend, resolve_backend
from kdaserve.backends.step import KDACache, KDAInputs, PrefillSeqs
from kdaserve.layers.kda import KDALayer
from kdaserve.layers.kda_routing import make_kda_metadata, run_kda_step
from kdaserve.layers.kda_weights import random_kda_checkpoint
from kdaserve.ops.kda.reference import kda_decode_reference, kda_prefill_reference
from kdaserve.testing.compare import tolerance_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def parse_lengths(text: str) -> list[int]:
    """'8192,1024x16' -> [8192] + [1024] * 16."""
    lengths = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        length, _, count = part.partition("x")
        lengths += [int(length)] * (int(count) if count else 1)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be positive token counts like '8192,1024x16', got {text!r}")
    return lengths


@dataclass
class ParityConfig:
    prefill_backends: list[str]
    decode_backends: list[str]
    heads: int = 2
    head_dim: int = 32
    hidden: int = 64
    gate: str = "bounded"
    lower_bound: float = -5.0
    slow_decay_heads: int = 0
    dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    conv_layout: str = "SD"
    lengths: list[int] = field(default_factory=lambda: [40, 7, 7, 7])
    decode_steps: int = 4
    mixed_chunk: int = 13
    spec_tokens: int = 0
    device: str = "cpu"
    seed: int = 0
    tolerance: float | None = None  # against the reference; pairs of backends get twice this
    piece: int = 8192               # the fp64 reference prefills at most this many tokens per call


class ErrorStat:
    """Relative RMS and max-abs error of x against ref, accumulated over several tensors."""

    def __init__(self) -> None:
        self.diff2 = self.ref2 = self.max_abs = 0.0
        self.finite = True

    def add(self, x: torch.Tensor, ref: torch.Tensor) -> "ErrorStat":
        x64, r64 = x.detach().double(), ref.detach().double()
        if not torch.isfinite(x64).all():
            self.finite = False
            return self
        d = x64 - r64
        self.diff2 += float(d.pow(2).sum())
        self.ref2 += float(r64.pow(2).sum())
        self.max_abs = max(self.max_abs, float(d.abs().max()) if d.numel() else 0.0)
        return self

    @property
    def rel(self) -> float:
        if not self.finite:
            return float("inf")
        return (self.diff2 / self.ref2) ** 0.5 if self.ref2 > 0 else self.diff2**0.5


@dataclass
class Row:
    phase: str
    backend: str
    against: str
    out: ErrorStat
    state: ErrorStat
    limit: float
    conv_exact: bool | None = None   # conv states bit-equal to the reference's (None: not compared)
    others_untouched: bool | None = None

    @property
    def ok(self) -> bool:
        return (self.out.rel < self.limit and self.state.rel < self.limit and self.conv_exact is not False
                and self.others_untouched is not False)


@dataclass
class Pools:
    conv: torch.Tensor
    rec: torch.Tensor

    def clone(self) -> "Pools":
        return Pools(self.conv.clone(), self.rec.clone())

    def to(self, conv_dtype, rec_dtype) -> "Pools":
        return Pools(self.conv.to(conv_dtype), self.rec.to(rec_dtype))


def _untouched(before: torch.Tensor, after: torch.Tensor, touched: list[int]) -> bool:
    keep = torch.tensor([s for s in range(before.shape[0]) if s not in set(touched)], dtype=torch.long, device=before.device)
    return torch.equal(before.index_select(0, keep), after.index_select(0, keep))


def _as_backend(given: ResolvedBackend | Callable | None, default: ResolvedBackend) -> ResolvedBackend:
    if given is None:
        return default
    return given if isinstance(given, ResolvedBackend) else dataclasses.replace(default, fn=given, planner=None)


class Parity:
    def __init__(self, cfg: ParityConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.dev = torch.device(cfg.device)
        lb = cfg.lower_bound if cfg.gate == "bounded" else None
        self.layer = KDALayer.build(
            cfg.hidden, cfg.heads, cfg.head_dim, lower_bound=lb, state_dtype=cfg.state_dtype, conv_layout=cfg.conv_layout,
            num_spec_tokens=cfg.spec_tokens, params_dtype=cfg.dtype, device=self.dev,
            prefill_backend="reference", decode_backend="reference",
        )
        ckpt = random_kda_checkpoint(cfg.hidden, cfg.heads, cfg.head_dim, gate=cfg.gate, slow_decay_heads=cfg.slow_decay_heads,
                                     dtype=cfg.dtype, device=self.dev, seed=cfg.seed)
        self.layer.load_weights(ckpt.items())
        self.weights = self.layer.kda_weights
        machine = Machine.detect(self.dev)
        self.prefills = self._resolve("prefill", cfg.prefill_backends, machine)
        self.decodes = self._resolve("decode", cfg.decode_backends, machine)
        self.tol = cfg.tolerance if cfg.tolerance is not None else tolerance_for(cfg.dtype, cfg.state_dtype)
        self.gen = torch.Generator(device=self.dev).manual_seed(cfg.seed + 1)
        N, S = len(cfg.lengths), cfg.spec_tokens
        self.home = list(range(1, N + 1))
        self.drafts = [list(range(N + 1 + n * S, N + 1 + (n + 1) * S)) for n in range(N)]
        self.spare = N * (S + 1) + 1                        # a fresh slot for a new prefill in the mixed step
        self.num_slots = self.spare + 2                     # + one slot nobody uses: must stay untouched
        self.rows: list[Row] = []

    def _resolve(self, phase: str, names: list[str], machine: Machine) -> dict[str, ResolvedBackend]:
        resolved = {}
        for name in names:
            r = resolve_backend(phase, name, self.layer.settings, machine)
            resolved[name if name != "auto" else f"auto={r.name}"] = r
        return resolved

    # ---- inputs and runs ------------------------------------------------------------------------

    def _inputs(self, T: int):
        x = torch.randn(T, self.cfg.hidden, generator=self.gen, device=self.dev).to(self.cfg.dtype)
        with torch.no_grad():
            qkv, beta, forget_logits, output_gate_logits = self.layer.project(x)
        return qkv, forget_logits, beta, output_gate_logits

    def _initial_pools(self) -> Pools:
        spec = self.layer.cache_spec()
        (conv_shape, conv_dtype), (rec_shape, rec_dtype) = spec["conv"], spec["recurrent"]
        conv = torch.randn(self.num_slots, *conv_shape, generator=self.gen, device=self.dev).to(conv_dtype)
        rec = (0.2 * torch.randn(self.num_slots, *rec_shape, generator=self.gen, device=self.dev)).to(rec_dtype)
        return Pools(conv, rec)

    def _working(self, pools64: Pools) -> Pools:
        spec = self.layer.cache_spec()
        return pools64.to(spec["conv"][1], spec["recurrent"][1])

    def _step(self, meta, inputs, pools: Pools, prefill: ResolvedBackend | Callable | None = None,
              decode: ResolvedBackend | Callable | None = None, out_dtype=None) -> torch.Tensor:
        """One step with the backend under test for its phase (the layer's reference for the other),
        built once as the engine builds it. A plain function runs as the reference backend's entry
        point (the fp64 ground truth)."""
        qkv, forget_logits, beta, output_gate_logits = inputs
        H, D = self.cfg.heads, self.cfg.head_dim
        out = torch.full((qkv.shape[0], H, D), float("nan"), dtype=out_dtype or self.cfg.dtype, device=self.dev)
        ref = self.layer.backends
        pair = dataclasses.replace(ref, prefill=_as_backend(prefill, ref.prefill), decode=_as_backend(decode, ref.decode))
        run_kda_step(pair.build_step(meta), KDAInputs(qkv, forget_logits, beta, output_gate_logits), self.weights,
                     KDACache(pools.conv, pools.rec, self.cfg.conv_layout), out, pair)
        return out

    def _reference_prefill_fp64(self, lengths, slots, his, inputs, pools64: Pools, t0: int = 0) -> torch.Tensor:
        """The ground truth, one sequence and at most `piece` tokens per call (exact: a split prefill
        equals the whole) so fp64 intermediates stay small at 128K tokens."""
        qkv, forget_logits, beta, output_gate_logits = inputs
        H, D = self.cfg.heads, self.cfg.head_dim
        out = torch.empty(qkv.shape[0], H, D, dtype=torch.float64, device=self.dev)
        t = t0
        for length, slot, h in zip(lengths, slots, his):
            for p0 in range(0, length, self.cfg.piece):
                p1 = min(p0 + self.cfg.piece, length)
                s = slice(t + p0, t + p1)
                cu = torch.tensor([0, p1 - p0], dtype=torch.int32)
                kda_prefill_reference(
                    KDAInputs(qkv[s].double(), forget_logits[s].double(), beta[s].double(), output_gate_logits[s].double()),
                    self.weights,
                    KDACache(pools64.conv, pools64.rec, self.cfg.conv_layout),
                    PrefillSeqs(cu.to(self.dev), torch.tensor([slot], dtype=torch.int32, device=self.dev),
                                torch.tensor([h or p0 > 0], device=self.dev), cu),
                    out[s], chunk_size=64,
                )
            t += length
        return out

    def _inputs64(self, inputs):
        return tuple(t.double() for t in inputs)

    # ---- comparisons ----------------------------------------------------------------------------

    def _compare(self, phase, outs, ref_out, pools, ref_pools: Pools, start: Pools, touched, conv_slots, valid=None):
        """Rows against the reference for each backend, then for each pair of backends."""
        sel = (lambda t: t[valid]) if valid is not None else (lambda t: t)
        idx = torch.tensor(sorted(set(touched)), dtype=torch.long, device=self.dev)
        cidx = torch.tensor(sorted(set(conv_slots)), dtype=torch.long, device=self.dev)
        for name, out in outs.items():
            p = pools[name]
            conv_exact = torch.equal(p.conv.index_select(0, cidx).double(), ref_pools.conv.index_select(0, cidx))
            untouched = _untouched(start.rec, p.rec, touched) and _untouched(start.conv, p.conv, conv_slots)
            self.rows.append(Row(
                phase, name, "reference(fp64)", ErrorStat().add(sel(out), sel(ref_out)),
                ErrorStat().add(p.rec.index_select(0, idx), ref_pools.rec.index_select(0, idx)), self.tol, conv_exact, untouched,
            ))
        for a, b in itertools.combinations(outs, 2):
            self.rows.append(Row(
                phase, a, b, ErrorStat().add(sel(outs[a]), sel(outs[b])),
                ErrorStat().add(pools[a].rec.index_select(0, idx), pools[b].rec.index_select(0, idx)), 2 * self.tol,
                torch.equal(pools[a].conv.index_select(0, cidx), pools[b].conv.index_select(0, cidx)),
            ))

    # ---- phases ---------------------------------------------------------------------------------

    def prefill_phase(self) -> Pools:
        cfg = self.cfg
        N = len(cfg.lengths)
        g = torch.Generator().manual_seed(cfg.seed + 2)
        his = [False] + (torch.rand(N - 1, generator=g) < 0.5).tolist()
        meta = make_kda_metadata(prefill_lens=cfg.lengths, prefill_slots=self.home, prefill_has_initial_state=his,
                                 device=self.dev)
        inputs = self._inputs(meta.num_tokens)
        start = self._initial_pools()
        ref_pools = start.to(torch.float64, torch.float64)
        self.log(f"prefill: {N} sequences, {meta.num_tokens} tokens ({sum(his)} resuming from history)")
        ref_out = self._reference_prefill_fp64(cfg.lengths, self.home, his, inputs, ref_pools)
        outs, pools = {}, {}
        for name, fn in self.prefills.items():
            pools[name] = start.clone()
            t = time.perf_counter()
            outs[name] = self._step(meta, inputs, pools[name], prefill=fn)
            self.log(f"  {name}: {time.perf_counter() - t:.2f} s")
        self._compare("prefill", outs, ref_out, pools, ref_pools, start, self.home, self.home)
        return ref_pools

    def decode_phase(self, ref_pools: Pools) -> Pools:
        cfg = self.cfg
        N = len(self.home)
        start = self._working(ref_pools)
        ref_pools = start.to(torch.float64, torch.float64)
        meta = make_kda_metadata(decode_slots=self.home + [0], device=self.dev)  # + one CUDA-graph padding row
        self.log(f"decode: {cfg.decode_steps} steps of {N} sequences + 1 padding row")
        pools = {name: start.clone() for name in self.decodes}
        outs: dict[str, list] = {name: [] for name in self.decodes}
        ref_outs = []
        for _ in range(cfg.decode_steps):
            inputs = self._inputs(N + 1)
            ref_outs.append(self._step(meta, self._inputs64(inputs), ref_pools, decode=kda_decode_reference,
                                       out_dtype=torch.float64)[:N])
            for name, fn in self.decodes.items():
                outs[name].append(self._step(meta, inputs, pools[name], decode=fn)[:N])
        cat = {name: torch.cat(o) if o else torch.empty(0, device=self.dev) for name, o in outs.items()}
        ref_cat = torch.cat(ref_outs) if ref_outs else torch.empty(0, device=self.dev)
        self._compare(f"decode x{cfg.decode_steps}", cat, ref_cat, pools, ref_pools, start, self.home, self.home)
        return ref_pools

    def mixed_phase(self, ref_pools: Pools) -> Pools:
        cfg = self.cfg
        N = len(self.home)
        start = self._working(ref_pools)
        if N > 1:
            dec, pre, his = self.home[: N // 2], self.home[N // 2 :], [True] * (N - N // 2)
        else:
            dec, pre, his = self.home, [self.spare], [False]
        lens = [cfg.mixed_chunk] * len(pre)
        meta = make_kda_metadata(decode_slots=dec, prefill_lens=lens, prefill_slots=pre, prefill_has_initial_state=his,
                                 device=self.dev)
        inputs = self._inputs(meta.num_tokens)
        ref = start.to(torch.float64, torch.float64)
        ref_out = self._step(meta, self._inputs64(inputs), ref, prefill=kda_prefill_reference, decode=kda_decode_reference,
                             out_dtype=torch.float64)
        self.log(f"mixed: {len(dec)} decodes + {len(pre)} prefill chunks of {cfg.mixed_chunk} tokens, "
                 f"{len(self.prefills) * len(self.decodes)} backend pairs")
        outs, pools = {}, {}
        for (pn, pf), (dn, df) in itertools.product(self.prefills.items(), self.decodes.items()):
            name = f"{pn}+{dn}"
            pools[name] = start.clone()
            outs[name] = self._step(meta, inputs, pools[name], prefill=pf, decode=df)
        self._compare("mixed", outs, ref_out, pools, ref, start, dec + pre, dec + pre)
        return ref

    def speculative_phase(self, ref_pools: Pools) -> None:
        cfg = self.cfg
        N, S = len(self.home), cfg.spec_tokens
        start = self._working(ref_pools)
        ref = start.to(torch.float64, torch.float64)
        spec_rows = [d + [h] for d, h in zip(self.drafts, self.home)] + [[0] * (S + 1)]  # resume slot last; a padding row
        g = torch.Generator().manual_seed(cfg.seed + 3)
        accepted_later = torch.randint(1, S + 2, (N,), generator=g).tolist()
        steps = [[S + 1] * N + [0], accepted_later + [0]]  # the first resumes after a plain step: all "accepted"
        self.log(f"speculative: 2 verify steps of {S + 1} tokens for {N} sequences + 1 padding row, then accepted "
                 f"{accepted_later}")
        pools = {name: start.clone() for name in self.decodes}
        outs: dict[str, list] = {name: [] for name in self.decodes}
        ref_outs = []
        T_real = N * (S + 1)
        for accepted in steps:
            meta = make_kda_metadata(decode_slots=self.home + [0], spec_slots=spec_rows, num_accepted_tokens=accepted,
                                     device=self.dev)
            inputs = self._inputs(meta.num_tokens)
            ref_outs.append(self._step(meta, self._inputs64(inputs), ref, decode=kda_decode_reference,
                                       out_dtype=torch.float64)[:T_real])
            for name, fn in self.decodes.items():
                outs[name].append(self._step(meta, inputs, pools[name], decode=fn)[:T_real])
        cat = {name: torch.cat(o) for name, o in outs.items()}
        touched = [s for row in spec_rows[:N] for s in row]
        self._compare("speculative", cat, torch.cat(ref_outs), pools, ref, start, touched, self.home)

    def run(self) -> list[Row]:
        with torch.inference_mode():
            pools = self.prefill_phase()
            pools = self.decode_phase(pools)
            pools = self.mixed_phase(pools)
            if self.cfg.spec_tokens:
                self.speculative_phase(pools)
        return self.rows


def format_table(rows: list[Row]) -> str:
    head = (f"{'phase':<12} {'backend':<22} {'vs':<22} {'out rel':>9} {'out max':>9} {'state rel':>9} {'state max':>9} "
            f"{'conv':>6} {'others':>7} {'limit':>8}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        conv = "-" if r.conv_exact is None else ("exact" if r.conv_exact else "DIFF")
        others = "-" if r.others_untouched is None else ("ok" if r.others_untouched else "TOUCHED")
        lines.append(
            f"{r.phase:<12} {r.backend:<22} {r.against:<22} {r.out.rel:>9.2e} {r.out.max_abs:>9.2e} {r.state.rel:>9.2e} "
            f"{r.state.max_abs:>9.2e} {conv:>6} {others:>7} {r.limit:>8.1e}  {'ok' if r.ok else 'FAIL'}"
        )
    return "\n".join(lines)


def run_parity(cfg: ParityConfig, log: Callable[[str], None] = print) -> int:
    """Run, print the table last, return 0 when every row is within its limit, else 1."""
    rows = Parity(cfg, log).run()
    log("")
    log(format_table(rows))
    bad = [r for r in rows if not r.ok]
    log(f"\n{len(rows) - len(bad)}/{len(rows)} comparisons within limits" + (f"; {len(bad)} FAILED" if bad else ""))
    return 1 if bad else 0
