"""The KDA kernels (flash-linear-attention's layout: one folder per op, its wrapper beside the
kernel) and the torch reference that defines them (reference/, docs/kda-semantics.md):

- reference/: the definition every kernel is judged by (chunked prefill, token-loop decode).
- conv/: the short causal conv, varlen prefill and decode update.
- flash/: the paged in-place prefill (K1 prepare, K2 recurrence, segment scan, correction).
- chain.py (conv -> recurrent/ -> gated norm), fused/ (one launch), adaptive.py: decode.
- types.py, checks.py, limits.py, host_tables.py: what every entry point takes, checks, accepts
  and plans on the host.
"""
