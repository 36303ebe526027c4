"""Pallas kernels, each next to its pure-jnp reference."""
