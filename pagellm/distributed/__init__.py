"""Tensor parallelism: this process's rank in its group and the collectives the model uses."""
