"""Triton kernels and the launcher that feeds them paddle tensors."""
