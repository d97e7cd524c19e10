"""4-bit float weights in plain torch: the definitions (OCP Microscaling spec v1.0; NVIDIA's NVFP4).

    e2m1 code c (4 bits): sign = bit 3, magnitude = E2M1[c & 7], E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6
    packing: two codes per byte along the input dimension, element 2k in the low nibble
    MXFP4  W[r, c] = e2m1(Wq[r, c]) * 2^(S[r, c // 32] - 127)       S uint8 e8m0 (255 = NaN)
    NVFP4  W[r, c] = e2m1(Wq[r, c]) * s[r, c // 16] / g             s float8_e4m3fn, g fp32 [1]

Quantizing (for tests, and for checkpoints written by kdaserve): MXFP4's shared exponent is
floor(log2(max|block|)) - 2 (e2m1's largest exponent), values beyond 6 x scale saturate; NVFP4's
global scale is 448 x 6 / max|W| and each block's scale max|block| / 6 x g rounded to e4m3. Values
round to the nearest e2m1 value (ties to the even code)."""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
MX_GROUP = 32          # MXFP4 values per scale
NV_GROUP = 16          # NVFP4 values per scale
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_E4M3_MAX = 448.0


def e2m1_values(device=None) -> torch.Tensor:
    """The 16 code values in fp32, codes 0..15 (8..15 negative)."""
    pos = torch.tensor(E2M1, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> fp32 [..., n]: element 2k from the low nibble, 2k+1 from the high one."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed e2m1 codes are uint8 (two per byte), got {packed.dtype}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return e2m1_values(packed.device)[codes.long()]


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> uint8 codes of the nearest e2m1 value,
    saturating at +-6, ties to the even code (0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2, 5 -> 4)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    grid = torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    below = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 6)   # index of the value at or below
    lo, hi = grid[below], grid[below + 1]
    up = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (below % 2 == 1))
    code = torch.where(up & (mag > lo), below + 1, below)
    return (code | ((x < 0) & (code > 0)).long() << 3).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n/2], element 2k in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"e2m1 codes pack two per byte: the last dimension must be even, got {codes.shape[-1]}")
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def _groups(x: torch.Tensor, group: int, what: str) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"{what}: the input dimension ({x.shape[-1]}) must be a multiple of {group}")
    return x.view(*x.shape[:-1], -1, group)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> torch.Tensor:
    """MXFP4 [out, in/2] uint8 with e8m0 scales [out, in/32] uint8 -> [out, in] in `dtype`."""
    values = unpack_e2m1(packed)
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (*values.shape[:-1], values.shape[-1] // MX_GROUP):
        raise ValueError(f"{name}: MXFP4 scales must be uint8 e8m0 {[*values.shape[:-1], values.shape[-1] // MX_GROUP]} "
                         f"(one per {MX_GROUP} values), got {scale.dtype} {list(scale.shape)}")
    check_mxfp4_scales(scale, name)
    factor = torch.exp2(scale.float() - E8M0_BIAS)
    return (_groups(values, MX_GROUP, name) * factor[..., None]).flatten(-2).to(dtype)


def check_mxfp4_scales(scale: torch.Tensor, name: str) -> None:
    """e8m0 code 255 is NaN: a damaged checkpoint, refused wherever its scales are read."""
    if (scale == E8M0_NAN).any():
        raise ValueError(f"{name}: an MXFP4 scale is NaN (e8m0 code {E8M0_NAN}): the checkpoint is damaged")


def check_nvfp4_scales(scale: torch.Tensor | None, global_scale: torch.Tensor | None, name: str) -> None:
    """Block scales finite and without a sign (NVFP4's block scales are unsigned e4m3, UE4M3, as
    NVIDIA's block-scaled MMA reads them; quantizers write amax / 6, never negative: the words
    decoder builds its factors from the bits without one, word_decode.nvfp4_scale_pair), the global
    scale finite and non-zero (either may be absent)."""
    if global_scale is not None:
        g = global_scale.float()
        if not torch.isfinite(g).all() or (g == 0).any():
            raise ValueError(f"{name}: the NVFP4 global scale must be finite and non-zero, got {g.flatten()[:4].tolist()}")
    if scale is None:
        return
    values = (scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale).float()   # uint8: e4m3's bits
    if not torch.isfinite(values).all():
        raise ValueError(f"{name}: an NVFP4 block scale is not finite: the checkpoint is damaged")
    if torch.signbit(values).any():
        raise ValueError(f"{name}: an NVFP4 block scale has its sign bit set (-0.0 or negative); block scales are unsigned "
                         f"e4m3 (UE4M3), each block's amax / 6 times the global scale: the checkpoint is damaged")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (packed uint8 [out, in/2], e8m0 scales uint8 [out, in/32]) by the OCP MX rules."""
    blocks = _groups(weight.float(), MX_GROUP, "quantize_mxfp4")
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_codes(blocks / torch.exp2(exp)[..., None]).flatten(-2)
    return pack_e2m1(codes), (exp + E8M0_BIAS).to(torch.uint8)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """NVFP4 [..., out, in/2] uint8 with fp8 e4m3 scales [..., out, in/16] and the fp32 global scale
    (which divides; one value, or one per row as [..., out, 1]) -> [..., out, in] in `dtype`."""
    values = unpack_e2m1(packed)
    if tuple(scale.shape) != (*values.shape[:-1], values.shape[-1] // NV_GROUP):
        raise ValueError(f"{name}: NVFP4 scales must be {[*values.shape[:-1], values.shape[-1] // NV_GROUP]} (one per "
                         f"{NV_GROUP} values), got {list(scale.shape)}")
    g = global_scale.float()
    g = g.reshape(()) if g.numel() == 1 else g
    if g.dim() and tuple(g.shape) != (*values.shape[:-1], 1):
        raise ValueError(f"{name}: the NVFP4 global scale must be one value or one per row, got {list(g.shape)}")
    check_nvfp4_scales(scale, g, name)
    s = scale.float()
    return (_groups(values, NV_GROUP, name) * (s / g)[..., None]).flatten(-2).to(dtype)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (packed uint8 [out, in/2], e4m3 scales [out, in/16], global scale fp32 [1])."""
    w = weight.float()
    g = (FP8_E4M3_MAX * E2M1_MAX / w.abs().amax().clamp_min(1e-12)).reshape(1)
    blocks = _groups(w, NV_GROUP, "quantize_nvfp4")
    scale = (blocks.abs().amax(-1) / E2M1_MAX * g).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    real = scale.float() / g
    codes = e2m1_codes(torch.where(real[..., None] > 0, blocks / real.clamp_min(1e-30)[..., None], 0.0)).flatten(-2)
    return pack_e2m1(codes), scale, g
