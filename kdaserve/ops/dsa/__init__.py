"""DeepSeek sparse attention's indexer with k-pools (GLM-5.3-Flash): which context tokens each
query attends to."""
