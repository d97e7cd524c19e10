"""4-bit floating-point weights (e2m1, OCP Microscaling): MXFP4 (one power-of-two e8m0 scale per 32
values, AMD Quark's checkpoints) and NVFP4 (an fp8 e4m3 scale per 16 values and a per-tensor fp32
global scale, compressed-tensors' `nvfp4-pack-quantized`). reference.py holds the definitions."""
