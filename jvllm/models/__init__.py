"""Flax model definitions, the architecture registry and the checkpoint loader."""
