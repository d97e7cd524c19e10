"""Prefix caching for KDA hybrids: a request whose prompt starts like an earlier one resumes
from that prefix instead of recomputing it.

Two caches make a prefix reusable, and both must hold it:
- the attention layers' KV blocks (paged KV, MLA's latent cache): full blocks, found by a chained
  hash of their tokens (hashing.py), shared by reference count, evicted LRU once no request holds
  them (engine/block_manager.py);
- the KDA layers' recurrent state and conv window, which exist once per sequence, not per token:
  a copy (a checkpoint) is kept only at token positions that are multiples of the checkpoint
  interval (`--mamba-block-size`, a multiple of the KV block size), in checkpoint slots of the
  state caches (checkpoints.py).

A hit (prefix_cache.py) restores the longest prefix that ends on a checkpoint: the blocks before it
are shared, the checkpoint is copied into the request's own state slot (a state is written as the
request goes on, so it is never shared), and only the rest is prefilled. Checkpoints are taken
inside the prefill launch at every boundary a chunk crosses (backends that take CheckpointRequests;
for the others a chunk that crosses one is cut there, at most one extra step per boundary), where a
chunk ends on one, and where a decode crosses one (so a chat's answer is reusable by its next
turn). With speculative decoding decode steps take none: a verify's state may be a rejected draft's.
"""

from kdaserve.engine.prefix_cache.disabled import NoPrefixCache
from kdaserve.engine.prefix_cache.prefix_cache import PrefixCache

__all__ = ["NoPrefixCache", "PrefixCache"]
