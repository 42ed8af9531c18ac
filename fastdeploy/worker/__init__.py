"""Model runner."""
