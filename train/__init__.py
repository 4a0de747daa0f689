"""train: a Flax training stack that uses jax_nvfp4 (configs, data, meshes, the loop, the CLI)."""
