"""Tensor parallelism: ranks, process groups and the collectives the model uses."""
