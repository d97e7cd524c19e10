"""KDA kernels and the torch reference that defines them (see docs/ and docs/kda-semantics.md)."""
