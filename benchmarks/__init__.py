"""Measurements of jax_nvfp4; each figure is a ratio to a baseline measured in the same run."""
