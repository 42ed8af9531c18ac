"""Custom operators."""
