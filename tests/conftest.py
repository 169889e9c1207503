"""Test session setup shared by every test file."""

import os

import pytest

# XLA's CPU compiler set for compile speed: the JAX tests compile about 1,200 programs, and
# XLA's backend compile is most of their time on 2 cores. LLVM at -O0 takes about a quarter
# off it, and XLA:CPU's earlier code generator (elemental IR emitters, in place of the
# MLIR fusion emitters) about half of the rest: on six JAX files, compile 267 s -> 199 s
# -> 103 s. Both compile the same optimized HLO (the HLO passes still run) with no
# fast-math, and the whole suite passes under either setting; only the machine code is
# less tuned. Set before JAX starts its CPU backend, and inherited by the processes
# the distributed tests start. A flag the caller set in XLA_FLAGS wins (e.g.
# XLA_FLAGS=--xla_cpu_use_fusion_emitters=true runs the suite on XLA's default emitters).
_XLA_TEST_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags, *(f"--{k}={v}" for k, v in _XLA_TEST_FLAGS.items() if k not in _flags)]
).strip()

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


# The files that take longest on a 2-core machine (process groups, compiled programs),
# slowest first, from a CI run's per-file times (`pytest --junitxml`, test times summed
# per file). `make test` runs the suite on pytest-xdist workers, a whole file at a time in
# collection order (--dist loadfile --no-loadscope-reorder): begun first, a long file does
# not keep one worker busy after the others have run out of files. The rest keep their
# order after these; a name not found here orders nothing.
SLOW_FILES = (
    "test_blocks_jax_paths.py",
    "test_jax_tracker.py",
    "test_jax_segments.py",
    "test_jax_summary.py",
    "test_torch_tracker.py",
    "test_higher_moments_jax.py",
    "test_distributed_jax.py",
    "test_integrations.py",
    "test_docs_examples.py",
    "test_report.py",
    "test_blocks_fused.py",
    "test_jax_device_path.py",
    "test_torch_fused.py",
    "test_jax_fastpath.py",
    "test_jax_pallas_offsets.py",
    "test_torch_compile.py",
    "test_jax_transforms.py",
    "test_blocks_jax.py",
    "test_torch_summary.py",
    "test_distributed_torch.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files of ``SLOW_FILES`` first (a stable sort: each file's own order stays)."""
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FILES)))
