"""Top-k routing of tokens to experts, DeepSeek-V3 style (Kimi-Linear, GLM-5.3-Flash, Ling):

    logits  = x @ W_gate^T                      in fp32 (the gate weight is kept in fp32)
    scores  = sigmoid(logits) (or softmax)
    choice  = scores + e_score_correction_bias   (the bias only chooses, it never weights)
    groups  : experts in `num_groups` equal groups; a group's score is the sum of its top-2
              choice scores; only the best `topk_groups` groups may be chosen from
    topk    = the `top_k` best choice scores among the allowed experts
    weights = scores of the chosen experts, divided by their sum (+1e-20) when `renormalize`,
              times `routed_scaling_factor`

Plain torch: a handful of small ops on [T, E], no host sync (CUDA-graph capturable); on a GPU
everything after the logits is one Triton launch (router_kernel.py), grouped or not."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "sigmoid"            # "sigmoid" or "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"router scoring must be 'sigmoid' or 'softmax', got {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must lie in [1, num_experts = {self.num_experts}], got {self.top_k}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"num_experts ({self.num_experts}) must split into num_groups ({self.num_groups}) equal groups")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups must lie in [1, num_groups = {self.num_groups}], got {self.topk_groups}")
        if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError(f"top_k = {self.top_k} experts cannot be chosen from {self.topk_groups} groups of "
                             f"{self.num_experts // self.num_groups}")

    @property
    def grouped(self) -> bool:
        """Whether routing is restricted to the best `topk_groups` of `num_groups` groups."""
        return self.num_groups > 1 and self.topk_groups < self.num_groups


def route_tokens(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None,
                 cfg: RouterConfig, *, use_kernel: bool | None = None,
                 extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64). After the logits,
    `use_kernel`: None = one Triton launch on a GPU (router_kernel.py) unless routing is restricted
    to groups, the torch path below otherwise; True / False force one (tests). `extra_expert`: one
    more column, that expert with weight 1 for every token (the shared expert as an expert)."""
    # ~8 torch kernels ungrouped, ~14 grouped: each a launch and a gap in a decode step's graph.
    # The logits: an fp32 cast and cuBLAS's fp32 GEMM, at every size (faster on an H200 at decode
    # than a Triton launch without the cast: docs/perf-notes.md).
    logits = F.linear(x.float(), gate_weight.float())
    grouped = cfg.grouped
    if use_kernel is None:
        use_kernel = x.is_cuda
    if use_kernel:
        from kdaserve.ops.moe.router_kernel import route_from_logits

        return route_from_logits(logits, bias, cfg.top_k, cfg.scoring, cfg.renormalize, cfg.routed_scaling_factor,
                                 extra_expert, cfg.num_groups if grouped else 1, cfg.topk_groups if grouped else 1)
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    if grouped:
        T = x.shape[0]
        by_group = choice.view(T, cfg.num_groups, -1)
        group_scores = by_group.topk(min(2, by_group.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    if extra_expert is not None:
        T = x.shape[0]
        weights = torch.cat([weights, weights.new_ones(T, 1)], dim=1)
        ids = torch.cat([ids, ids.new_full((T, 1), extra_expert)], dim=1)
    return weights, ids
