"""The KDA layer's checkpoint tensors (docs/kda-semantics.md section 4): names, tensor-parallel shards,
and random-but-realistic weights for tests, benchmarks and `kdaserve parity`.

Two gate forms exist. Kimi-Linear and GLM-5.3-Flash compute the forget and output gate logits in
low rank (f_a [D, hidden] then f_b [P, D], likewise g); Ling-3 (bailing_hybrid) in full rank
(f_proj, g_proj [P, hidden]). Both are rows of the one merged projection `in_proj_qkvbfg_a`:
q | k | v | b | f_a | g_a (3P + H + 2D rows) or q | k | v | b | f | g (5P + H rows).

Under tensor parallelism the heads are split across ranks: rank r owns heads [r*H, (r+1)*H) of
q, k, v, b, the forget/output gate up-projections (or full-rank gates), the conv channels, A_log,
dt_bias and the o_proj input columns; the low-rank inputs f_a and g_a (D rows each) are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHECKPOINT_NAMES = (
    "in_proj_qkvbfg_a.weight", "f_b_proj.weight", "g_b_proj.weight",
    "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "A_log", "dt_bias", "o_norm.weight", "o_proj.weight",
)
CONV_NAMES = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
# Released checkpoints (Kimi-Linear, GLM-5.3-Flash) store the rows of in_proj_qkvbfg_a apart, in this
# order; each is loaded into its rows of the merged projection (one GEMM at run time).
IN_PROJ_PARTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "f_a_proj.weight", "g_a_proj.weight")
# Ling-3's full-rank gates: the rows of f_proj and g_proj take the place of f_a | g_a, and there is
# no second gate projection.
FULL_RANK_IN_PROJ_PARTS = IN_PROJ_PARTS[:4] + ("f_proj.weight", "g_proj.weight")
_LOW_RANK_ONLY = ("f_b_proj.weight", "g_b_proj.weight")


@dataclass(frozen=True)
class KDAShard:
    """One rank's share of a layer of `total_heads` heads of size D."""

    hidden_size: int
    total_heads: int
    head_dim: int
    conv_width: int
    tp_rank: int = 0
    tp_size: int = 1
    full_rank_gates: bool = False   # f_proj / g_proj [P, hidden] (Ling-3) instead of f_a, f_b, g_a, g_b

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must lie in [0, tp_size), got rank {self.tp_rank} of {self.tp_size}")
        if self.total_heads % self.tp_size:
            raise ValueError(f"{self.total_heads} KDA heads cannot be split evenly over tp_size={self.tp_size} ranks")

    @property
    def heads(self) -> int:
        return self.total_heads // self.tp_size

    @property
    def P(self) -> int:
        return self.heads * self.head_dim

    @property
    def total_P(self) -> int:
        return self.total_heads * self.head_dim

    @property
    def gate_rows(self) -> int:
        """Rows of each gate's logits input in the merged projection on this rank: P (full rank) or D."""
        return self.P if self.full_rank_gates else self.head_dim

    @property
    def in_proj_rows(self) -> int:
        return 3 * self.P + self.heads + 2 * self.gate_rows

    @property
    def in_proj_parts(self) -> tuple[str, ...]:
        """The released tensors the merged projection's rows come from, in order."""
        return FULL_RANK_IN_PROJ_PARTS if self.full_rank_gates else IN_PROJ_PARTS

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """The layer's parameters by checkpoint name (no second gate projections with full-rank gates)."""
        return tuple(n for n in CHECKPOINT_NAMES if not (self.full_rank_gates and n in _LOW_RANK_ONLY))

    def in_proj_part(self, name: str, t: torch.Tensor) -> tuple[slice, torch.Tensor]:
        """(rows of this rank's in_proj_qkvbfg_a, this rank's part) of a released split projection."""
        D, Ht, P, H = self.head_dim, self.total_heads, self.P, self.heads
        per_head = {"q_proj.weight": D, "k_proj.weight": D, "v_proj.weight": D, "b_proj.weight": 1}
        if self.full_rank_gates and name in ("f_proj.weight", "g_proj.weight"):   # by heads, like q
            self._expect(name, t, (Ht * D, self.hidden_size), "[H*D, hidden]")
            start = 3 * P + H + (P if name == "g_proj.weight" else 0)
            return slice(start, start + P), _part(t, 0, self.head_slice(D))
        if name in per_head:
            rows = Ht * per_head[name]
            self._expect(name, t, (rows, self.hidden_size), "[H*D, hidden]" if per_head[name] == D else "[H, hidden]")
            i = IN_PROJ_PARTS.index(name)
            start = i * P if i < 3 else 3 * P
            n = P if i < 3 else H
            return slice(start, start + n), _part(t, 0, self.head_slice(per_head[name]))
        if name in ("f_a_proj.weight", "g_a_proj.weight") and not self.full_rank_gates:  # replicated on every rank
            self._expect(name, t, (D, self.hidden_size), "[D, hidden]")
            start = 3 * P + H + (D if name == "g_a_proj.weight" else 0)
            return slice(start, start + D), t
        raise KeyError(f"{name!r} is not a part of in_proj_qkvbfg_a; parts: {', '.join(self.in_proj_parts)}")

    def head_slice(self, per_head: int = 1) -> slice:
        n = self.heads * per_head
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    # ---- full checkpoint tensor -> this rank's tensor (views where possible) ---------------------

    def _expect(self, name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must be {what} = {list(shape)} for {self.total_heads} heads of {self.head_dim} "
                f"(all ranks, hidden {self.hidden_size}, conv width {self.conv_width}), got {list(t.shape)}"
            )

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor `name`, shaped like the layer's parameter."""
        D, Pt, Ht = self.head_dim, self.total_P, self.total_heads
        if name == "in_proj_qkvbfg_a.weight":
            G = Pt if self.full_rank_gates else D
            self._expect(name, t, (3 * Pt + Ht + 2 * G, self.hidden_size), "[5P+H, hidden]" if self.full_rank_gates
                         else "[3P+H+2D, hidden]")
            q, k, v, b, f, g = t.split([Pt, Pt, Pt, Ht, G, G])
            hp = self.head_slice(D)
            if self.full_rank_gates:
                f, g = f[hp], g[hp]
            return torch.cat([q[hp], k[hp], v[hp], b[self.head_slice()], f, g])
        if name in _LOW_RANK_ONLY and not self.full_rank_gates:
            self._expect(name, t, (Pt, D), "[P, D]")
            return _part(t, 0, self.head_slice(D))
        if name in CONV_NAMES:
            if t.dim() == 2:
                t = t.unsqueeze(1)
            self._expect(name, t, (Pt, 1, self.conv_width), "[P, 1, W]")
            return _part(t, 0, self.head_slice(D))
        if name == "A_log":
            if t.numel() != Ht:  # 1-D [H] (GLM) or [1, 1, H, 1] (Kimi-Linear) are both fine
                raise ValueError(f"A_log must hold {Ht} values (one per head, any shape such as [H] or [1, 1, H, 1]), got "
                                 f"{list(t.shape)}")
            return t.reshape(Ht)[self.head_slice()]
        if name == "dt_bias":
            if t.numel() != Pt:
                raise ValueError(f"dt_bias must hold P = {Pt} values ([P] or [H, D]), got {list(t.shape)}")
            return t.reshape(Pt)[self.head_slice(D)]
        if name == "o_norm.weight":
            self._expect(name, t, (D,), "[D]")
            return t
        if name == "o_proj.weight":
            self._expect(name, t, (self.hidden_size, Pt), "[hidden, P]")
            return _part(t, 1, self.head_slice(D))
        raise KeyError(f"unknown KDA checkpoint tensor {name!r}; valid names: {', '.join(self.checkpoint_names)}")


def _part(t: torch.Tensor, dim: int, s: slice) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) `s` of `t`: a view of a tensor, and of a checkpoint tensor
    not read yet (models/checkpoint_tensor.py) only that part read."""
    return t.narrow(dim, s.start, s.stop - s.start)


def random_kda_checkpoint(
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    *,
    conv_width: int = 4,
    gate: str = "bounded",
    slow_decay_heads: int = 0,
    full_rank_gates: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Full (unsharded) checkpoint tensors of one layer, scaled like a trained model: unit-variance
    q|k|v, beta and gate logits for unit-variance hidden states, exp(A_log) in [1, 16].
    `slow_decay_heads` of the last heads get gates near 0 (the hard case at long context).
    `full_rank_gates`: Ling-3's form (in_proj_qkvbfg_a holds f and g [P, hidden] each; no f_b, g_b)."""
    if gate not in ("bounded", "unbounded"):
        raise ValueError(f"gate must be 'bounded' or 'unbounded', got {gate!r}")
    g = torch.Generator().manual_seed(seed)
    H, D, P, W = num_heads, head_dim, num_heads * head_dim, conv_width

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    G = P if full_rank_gates else D
    in_proj = randn(3 * P + H + 2 * G, hidden_size, scale=hidden_size**-0.5)
    in_proj[3 * P : 3 * P + H] *= 2.0  # beta logits: spread beta over (0, 1)
    A_log = torch.rand(H, generator=g).mul(15).add(1).log()
    dt_bias = randn(H, D, scale=0.5)
    if slow_decay_heads:
        s = slice(H - slow_decay_heads, H)
        if gate == "bounded":
            A_log[s], dt_bias[s] = 0.0, -12.0  # sigmoid(~-12): gk ~ -3e-5
        else:
            A_log[s], dt_bias[s] = -9.0, -3.0  # exp(-9) * softplus(~-3): gk ~ -6e-6
    ckpt = {
        "in_proj_qkvbfg_a.weight": in_proj.to(dtype),
        "f_b_proj.weight": randn(P, D, scale=D**-0.5).to(dtype),
        "g_b_proj.weight": randn(P, D, scale=D**-0.5).to(dtype),
        "A_log": A_log,
        "dt_bias": dt_bias.reshape(P),
        "o_norm.weight": 1.0 + 0.1 * randn(D),
        "o_proj.weight": randn(hidden_size, P, scale=P**-0.5).to(dtype),
    }
    for name in CONV_NAMES:
        ckpt[name] = randn(P, 1, W, scale=W**-0.5)
    if full_rank_gates:
        for name in _LOW_RANK_ONLY:
            del ckpt[name]
    return {k: v.to(device) for k, v in ckpt.items()}
