"""kdaserve: a serving runtime for hybrid language models whose linear-attention layers are KDA."""

__version__ = "0.1.0"
