"""The hybrid model, its config, built-in configurations, tokenizers and the checkpoint loader."""
