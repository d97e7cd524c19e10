"""KDA kernels and the torch reference that defines them (see docs/ and kda-semantics.md)."""
