"""KV cache block allocation and prefix caching."""
