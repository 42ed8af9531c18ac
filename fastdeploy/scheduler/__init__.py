"""Continuous batching with chunked prefill under a token budget."""
