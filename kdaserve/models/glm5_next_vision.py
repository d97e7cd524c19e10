"""GLM-5.3-Flash's vision tower (`model.visual.*` of the released checkpoint), in torch: the math of
transformers' `Glm5NextVisionModel`, written for kdaserve.

    patches [N, 3 x 2 x 14 x 14] -> patch embedding (a 3-D convolution whose stride is its kernel: one
    matmul) -> `depth` pre-norm blocks (RMSNorm; attention with per-head q/k RMSNorm and 2-D axial
    rotary over the whole head, bidirectional within each image; a clamped SwiGLU MLP) -> RMSNorm ->
    2 x 2 merge (a strided 2-D convolution to out_hidden_size) -> merger (linear, LayerNorm, GELU,
    clamped SwiGLU) -> [N / 4, out_hidden_size]: one embedding per image placeholder token.

Attention runs image by image (torch's scaled_dot_product_attention over each image's patches, no
padding between images: they never attend to each other). The patches of an image arrive ordered
by 2 x 2 merge blocks (models/glm5_next_images.py), so the merge is a reshape."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Glm5NextVisionConfig:
    """`vision_config` of a GLM-5.3-Flash config.json (transformers' names and defaults)."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536
    intermediate_size: int = 4096
    projection_intermediate_size: int = 10240
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    attention_bias: bool = True
    hidden_act: str = "silu"
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "axial"})

    @classmethod
    def from_dict(cls, d: dict) -> Glm5NextVisionConfig:
        names = {f.name for f in fields(cls)}
        aliases = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
        kw = {aliases.get(k, k): v for k, v in d.items() if aliases.get(k, k) in names}
        config = cls(**kw)
        if config.hidden_act != "silu" or config.rope_parameters.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config: kdaserve runs the silu activation and axial rotary, got "
                             f"{config.hidden_act!r} and {config.rope_parameters.get('rope_type')!r}")
        if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
            raise ValueError(f"vision_config: hidden_size {config.hidden_size} over {config.num_heads} heads must give a "
                             f"head size that is a multiple of 4 (axial rotary halves it twice)")
        return config

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in fp32 and rounded to x's dtype before the weight, as transformers does, in one
        # fused kernel on a GPU (a one-image tower call is bound by its launches).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def _linear(i: int, o: int, bias: bool, dtype, device) -> nn.Linear:
    lin = nn.Linear(i, o, bias=bias, dtype=dtype, device=device)
    lin.requires_grad_(False)
    return lin


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int, limit: float, bias: bool, dtype, device):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(dim, inner, bias, dtype, device), _linear(dim, inner, bias, dtype, device)
        self.down_proj = _linear(inner, dim, bias, dtype, device)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class _Attention(nn.Module):
    def __init__(self, c: Glm5NextVisionConfig, dtype, device):
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.head_dim
        self.qkv = _linear(c.hidden_size, 3 * c.hidden_size, c.attention_bias, dtype, device)
        self.proj = _linear(c.hidden_size, c.hidden_size, c.attention_bias, dtype, device)
        self.q_norm = _RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = _RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.heads, self.head_dim)
        # q and k normed and rotated together, one kernel for both at each step (a one-image call is
        # bound by its launches); the same math as each alone (_RMSNorm's).
        norms = torch.stack([self.q_norm.weight, self.k_norm.weight])[:, None]
        qk = norms * F.rms_norm(qkv[:, :2], (self.head_dim,), eps=self.q_norm.eps)
        q, k = _rotate(qk, cos[:, None, None], sin[:, None, None]).unbind(1)
        v = qkv[:, 2]
        out = torch.empty_like(q)
        start = 0
        for length, count in _runs(lengths):   # each image attends to itself only, no padding:
            s = slice(start, start + length * count)   # images of one size in one batched call
            heads_first = lambda t: t[s].view(count, length, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
            o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v))
            out[s] = o.transpose(1, 2).reshape(count * length, self.heads, self.head_dim)
            start += length * count
        return self.proj(out.reshape(n, -1))


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive equal lengths as (length, count): random-mm's images (one size) are one run."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the whole head (rotate-half pairs), in fp32, back to x's dtype; cos / sin
    broadcast over x's middle dimensions."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, c: Glm5NextVisionConfig, dtype, device):
        super().__init__()
        self.norm1 = _RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.norm2 = _RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.attn = _Attention(c, dtype, device)
        self.mlp = _SwiGLU(c.hidden_size, c.intermediate_size, c.swiglu_limit, c.attention_bias, dtype, device)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, c: Glm5NextVisionConfig, dtype, device):
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel, dtype=dtype, device=device)
        self.proj.requires_grad_(False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A convolution whose stride is its kernel, over inputs of exactly one kernel: one matmul.
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _Merger(nn.Module):
    def __init__(self, c: Glm5NextVisionConfig, dtype, device):
        super().__init__()
        d = c.out_hidden_size
        self.proj = _linear(d, d, False, dtype, device)
        self.post_projection_norm = nn.LayerNorm(d, dtype=dtype, device=device)
        self.post_projection_norm.requires_grad_(False)
        self.gate_proj = _linear(d, c.projection_intermediate_size, False, dtype, device)
        self.up_proj = _linear(d, c.projection_intermediate_size, False, dtype, device)
        self.down_proj = _linear(c.projection_intermediate_size, d, False, dtype, device)
        self.limit = c.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Glm5NextVisionTower(nn.Module):
    """pixel_values [N, 3 x t x p x p] of images with grids (1, h, w) -> [N / merge^2, out_hidden_size]."""

    def __init__(self, config: Glm5NextVisionConfig, *, dtype=None, device=None):
        super().__init__()
        self.config = c = config
        self.patch_embed = _PatchEmbed(c, dtype, device)
        self.blocks = nn.ModuleList(_Block(c, dtype, device) for _ in range(c.depth))
        self.post_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        m = c.spatial_merge_size
        self.downsample = nn.Conv2d(c.hidden_size, c.out_hidden_size, m, stride=m, dtype=dtype, device=device)
        self.downsample.requires_grad_(False)
        self.merger = _Merger(c, dtype, device)
        spatial = c.head_dim // 2
        theta = float(c.rope_parameters.get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device)
                                                         / spatial)), persistent=False)

    def rotary(self, grids: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim]: each patch's (row, column) angles, in the patches' merge-block order."""
        m = self.config.spatial_merge_size
        pos = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            blocks = (h // m, m, w // m, m)
            pos.append(torch.stack([rows.reshape(blocks).transpose(1, 2).flatten(),
                                    cols.reshape(blocks).transpose(1, 2).flatten()], -1).repeat(t, 1))
        freqs = torch.cat(pos).float()[..., None] * self.inv_freq.to(device)    # [N, 2, spatial / 2]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        c = self.config
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{pixel_values.shape[0]} patches for grids {grids} (which hold "
                             f"{sum(t * h * w for t, h, w in grids)})")
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grids, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.post_layernorm(x)
        m = c.spatial_merge_size
        x = x.view(-1, m, m, c.hidden_size).permute(0, 3, 1, 2)   # each 2 x 2 merge block
        w = self.downsample.weight
        x = F.linear(x.reshape(x.shape[0], -1), w.reshape(w.shape[0], -1), self.downsample.bias)
        return self.merger(x)
