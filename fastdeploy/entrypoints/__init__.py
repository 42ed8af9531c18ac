"""Offline and HTTP entrypoints."""
