"""Structured output: a grammar (JSON schema, regex, choice, EBNF grammar) decides which tokens a
request may sample next, through xgrammar (an optional dependency, imported when first used).

- params.py: `StructuredOutputsParams`, vLLM's request field, checked when built.
- compiler.py: the tokenizer's vocabulary as xgrammar sees it (special tokens never allowed),
  grammars compiled once and cached; the server compiles in a worker thread.
- bitmask.py: each step, the rows with a grammar get their allowed-token bitmask filled on the
  host, staged in one copy and applied to their logits (processed logits only: log-probs stay
  those of the model).

A request's matcher (one per sequence, so the `n` samples of a request advance on their own)
accepts every sampled token; once it reaches the grammar's end (a stop token accepted), the request
finishes with reason "stop". A preempted request keeps its matcher: its outputs are recomputed, not
resampled. With speculative decoding, drafts are cut to what the grammar allows and each verify
row is masked by the grammar after the drafts before it (bitmask.py). Not combined with
min_tokens (refused, saying why)."""

from kdaserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
