"""Block-scaled FP8 (DeepSeek-V3's format, GLM-5.3-Flash's release): weights in float8_e4m3fn with
one fp32 factor per block of rows x columns (`weight_scale_inv`, 128 x 128 as released);
activations quantized on the fly per token and group of K columns (group = the weight's column
block), so each K block of a GEMM is one FP8 tensor-core dot times a row scale and a column scale.

reference.py holds the definitions; quant.py the activation quantizer; block_gemm.py the linear
layer's GEMM; ops/moe/fused.py takes the same scales for the grouped expert GEMMs."""

from kdaserve.ops.fp8.reference import (
                                        FP8_MAX,
                                        block_fp8_linear_reference,
                                        dequantize_blocks,
                                        quantize_blocks,
                                        quantize_per_token_group_reference,
)

__all__ = ["FP8_MAX", "block_fp8_linear_reference", "dequantize_blocks", "quantize_blocks",
           "quantize_per_token_group_reference"]
