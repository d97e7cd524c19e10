"""Benchmarks and validation tools: kernel benchmarks, the serving benchmark client, the A/B
harness, parity (`kdaserve parity`) and accuracy checks."""
