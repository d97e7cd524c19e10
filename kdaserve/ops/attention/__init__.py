"""Kernels of the full-attention layers (the KDA layers' neighbours in a hybrid model)."""
