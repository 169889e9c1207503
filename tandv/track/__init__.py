"""Trackers: ``tandv.track.torch`` (PyTorch) and ``tandv.track.jax`` (JAX/Flax)."""
