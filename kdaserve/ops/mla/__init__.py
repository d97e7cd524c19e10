"""Multi-head latent attention (MLA) kernels over a paged **latent** cache.

Per token and layer the cache keeps one row `[L + R]`: the normalized KV latent (L =
kv_lora_rank, 512 in Kimi-Linear) and the key part R shared by all heads (qk_rope_head_dim, 64;
rotated when the model uses RoPE, raw when it does not). Cache `[num_blocks, block_size, L + R]`.

- decode (absorbed): queries are projected into the latent space (q_nope W_UK per head), every
  head attends over the same latent rows (one read per token), and the output stays a latent
  `[B, H, L]` that the layer projects with W_UV.
- prefill: the context's latents are expanded by kv_b_proj into per-head keys and values, then a
  varlen causal attention whose scores are q_nope·k_nope + q_pe·k_pe; queries of a later chunk sit
  after the sequence's earlier tokens.

The torch reference (reference.py) defines both; the Triton kernels (decode.py, prefill.py) are
judged against it.
"""

from kdaserve.ops.mla.reference import mla_decode_reference, mla_prefill_reference

__all__ = ["mla_decode_reference", "mla_prefill_reference"]
