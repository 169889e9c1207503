"""Test session setup shared by every test file."""

import os

import pytest

# JAX must see two CPU devices for the sharding tests; this has to happen before
# the first JAX operation anywhere in the session.
try:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
except ImportError:  # JAX tests skip themselves
    pass

os.environ.setdefault("MPLBACKEND", "Agg")

# Without a GPU, tandv's Triton kernels run in Triton's interpreter on CPU tensors; this
# must be set before they are imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # torch tests skip themselves
    pass


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own temporary directory, so default log folders
    (``tandv_logs/``) never land in the repository."""
    monkeypatch.chdir(tmp_path)
