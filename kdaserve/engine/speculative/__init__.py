"""Speculative decoding: drafts proposed cheaply, verified by one forward of the target model.

- config.py: `--speculative-config` (vLLM's JSON: method, num_speculative_tokens, prompt lookup).
- ngram_proposer.py: prompt-lookup drafts from a sequence's own tokens (no draft model).
- mtp_drafter.py: drafts from the model's multi-token-prediction layer (GLM-5.3-Flash), made after
  each step's forward; mtp_proposer.py holds them until the verify that checks them.
- rejection_sampler.py: lossless acceptance (greedy match; rejection sampling for temperature > 0).

How a verify step keeps the KDA state exact (docs/speculative-decoding.md has the whole design):
a verifying sequence owns S+1 state slots; the recurrence of a step resumes from the slot of the
last accepted token and writes the state after each of its S+1 tokens into its own slot, the conv
window resumes after the accepted rows, and the attention layers see each of the S+1 tokens as a
decode row whose context ends at that token, so rejected drafts are overwritten, never read.
"""

from kdaserve.engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
