"""Attention backends and the sparse MLA interface."""
