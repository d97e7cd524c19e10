"""Hyper-connection (mHC) weights and stream update: the torch reference and two Triton kernels."""
