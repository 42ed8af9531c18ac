"""Command-line tools: make_tiny_model."""
