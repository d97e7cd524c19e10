"""Random-but-valid inputs for one KDA layer step, shaped like a real serving step.

q|k|v and the beta logits are column views of one projection buffer (as the layer produces them),
slots are a random permutation of the pool (slot 0 stays the null slot), some heads can be made
slow-decaying (gates near 0, the hard case for long-context precision).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights, PrefillSeqs, check_conv_layout


@dataclass
class KDACase:
    H: int
    D: int
    seq_lens: list[int]
    proj: torch.Tensor          # [T, 3P + H + 2D] projection output (q, k, v, b, f_a, g_a)
    qkv: torch.Tensor           # [T, 3P] view into proj
    beta_logits: torch.Tensor   # [T, H] view into proj
    forget_logits: torch.Tensor            # [T, H, D]
    output_gate_logits: torch.Tensor            # [T, H, D]
    weights: KDAWeights
    conv_state: torch.Tensor
    recurrent_state: torch.Tensor
    conv_layout: str
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    @property
    def T(self) -> int:
        return self.qkv.shape[0]

    @property
    def N(self) -> int:
        return len(self.seq_lens)

    def new_out(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A NaN-filled [T, H, D] output buffer."""
        return torch.full((self.T, self.H, self.D), float("nan"), dtype=dtype or self.qkv.dtype, device=self.qkv.device)

    def clone(self) -> "KDACase":
        """Deep copy (pools included) so two backends can run from identical starting caches.
        The copy's qkv/beta views still point into its own copy of `proj`."""
        c = copy.copy(self)
        c.proj = self.proj.clone()
        P = self.H * self.D
        c.qkv, c.beta_logits = c.proj[:, : 3 * P], c.proj[:, 3 * P : 3 * P + self.H]
        if not _is_view_of(self.qkv, self.proj):
            c.qkv, c.beta_logits = c.qkv.contiguous(), c.beta_logits.contiguous()
        c.conv_state = self.conv_state.clone()
        c.recurrent_state = self.recurrent_state.clone()
        return c

    @property
    def inputs(self) -> KDAInputs:
        return KDAInputs(self.qkv, self.forget_logits, self.beta_logits, self.output_gate_logits)

    @property
    def cache(self) -> KDACache:
        return KDACache(self.conv_state, self.recurrent_state, self.conv_layout)

    @property
    def prefill_seqs(self) -> PrefillSeqs:
        return PrefillSeqs(self.cu_seqlens, self.state_indices, self.has_initial_state, self.cu_seqlens_cpu)

    def prefill_args(self) -> dict:
        """The keyword arguments of a prefill entry point (all but `out`), from the case as it is now."""
        return dict(inputs=self.inputs, weights=self.weights, cache=self.cache, seqs=self.prefill_seqs)

    def decode_args(self, spec_state_indices: torch.Tensor | None = None,
                    num_accepted_tokens: torch.Tensor | None = None) -> dict:
        """The keyword arguments of a decode entry point (all but `out`); a verify step with the
        speculative slots given."""
        return dict(inputs=self.inputs, weights=self.weights, cache=self.cache,
                    seqs=DecodeSeqs(self.state_indices, spec_state_indices, num_accepted_tokens))


def _is_view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def make_kda_weights(
    H: int, D: int, *, gate: str = "bounded", lower_bound: float = -5.0, slow_decay_heads: int = 0,
    conv_width: int = 4, device="cpu", generator: torch.Generator | None = None,
) -> KDAWeights:
    if gate not in ("bounded", "unbounded"):
        raise ValueError(f"gate must be 'bounded' or 'unbounded', got {gate!r}")
    kw = dict(generator=generator, dtype=torch.float32)
    P = H * D
    conv_weight = torch.randn(3 * P, conv_width, **kw) * conv_width**-0.5
    # A_log as in real checkpoints: exp(A_log) in about [1, 16].
    A_log = torch.rand(H, **kw).mul(16 - 1).add(1).log()
    dt_bias = torch.randn(H, D, **kw) * 0.5
    if slow_decay_heads:
        s = slice(H - slow_decay_heads, H)
        if gate == "bounded":
            A_log[s], dt_bias[s] = 0.0, -12.0  # sigmoid(~-12) ~ 6e-6: gk ~ -3e-5
        else:
            A_log[s], dt_bias[s] = -9.0, -3.0  # exp(-9) * softplus(~-3): gk ~ -6e-6
    norm_weight = 1.0 + 0.1 * torch.randn(D, **kw)
    w = KDAWeights(
        conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight,
        lower_bound=lower_bound if gate == "bounded" else None,
    )
    for f in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
        setattr(w, f, getattr(w, f).to(device))
    return w


def make_kda_case(
    seq_lens: list[int],
    H: int = 4,
    D: int = 16,
    *,
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
    conv_dtype: torch.dtype | None = None,
    device="cpu",
    gate: str = "bounded",
    lower_bound: float = -5.0,
    slow_decay_heads: int = 0,
    strided: bool = True,
    has_initial_state: bool | list[bool] | None = None,
    conv_layout: str = "SD",
    spec_tokens: int = 0,
    extra_slots: int = 3,
    conv_width: int = 4,
    seed: int = 0,
    weights: KDAWeights | None = None,
) -> KDACase:
    """One step's inputs for sequences of `seq_lens` new tokens.

    has_initial_state: None = random per sequence, a bool for all, or a list. Pools are filled
    with random history in every slot (used or not), so untouched-slot checks are meaningful.
    """
    check_conv_layout(conv_layout)
    g = torch.Generator().manual_seed(seed)
    P, T, N = H * D, sum(seq_lens), len(seq_lens)
    weights = weights or make_kda_weights(
        H, D, gate=gate, lower_bound=lower_bound, slow_decay_heads=slow_decay_heads,
        conv_width=conv_width, device=device, generator=g,
    )
    proj = torch.randn(T, 3 * P + H + 2 * D, generator=g).to(dtype)
    proj[:, 3 * P : 3 * P + H] *= 2.0  # beta logits: spread beta over (0, 1)
    proj = proj.to(device)
    qkv, beta_logits = proj[:, : 3 * P], proj[:, 3 * P : 3 * P + H]
    if not strided:
        qkv, beta_logits = qkv.contiguous(), beta_logits.contiguous()
    forget_logits = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    output_gate_logits = torch.randn(T, H, D, generator=g).to(dtype).to(device)

    num_slots = 1 + N * (spec_tokens + 1) + extra_slots
    L = conv_width - 1 + spec_tokens
    conv_dtype = conv_dtype or dtype
    conv = torch.randn(num_slots, L, 3 * P, generator=g).to(conv_dtype)
    conv_state = (conv if conv_layout == "SD" else conv.transpose(1, 2).contiguous()).to(device)
    # States like a real run's: bounded entries of mixed sign, norm comparable to k v^T sums.
    recurrent_state = (torch.randn(num_slots, H, D, D, generator=g) * 0.2).to(state_dtype).to(device)

    perm = torch.randperm(num_slots - 1, generator=g)[:N] + 1
    state_indices = perm.to(torch.int32).to(device)
    if has_initial_state is None:
        his = torch.rand(N, generator=g) < 0.5
    elif isinstance(has_initial_state, bool):
        his = torch.full((N,), has_initial_state, dtype=torch.bool)
    else:
        his = torch.tensor(has_initial_state, dtype=torch.bool)
    cu_cpu = torch.zeros(N + 1, dtype=torch.int32)
    cu_cpu[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
    return KDACase(
        H=H, D=D, seq_lens=list(seq_lens), proj=proj, qkv=qkv, beta_logits=beta_logits, forget_logits=forget_logits,
        output_gate_logits=output_gate_logits,
        weights=weights, conv_state=conv_state, recurrent_state=recurrent_state, conv_layout=conv_layout,
        cu_seqlens=cu_cpu.to(device), cu_seqlens_cpu=cu_cpu, state_indices=state_indices,
        has_initial_state=his.to(device),
    )
