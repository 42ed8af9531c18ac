"""Tokenizer and chat template."""
