"""Test session setup shared by every test file."""

import importlib.metadata
import os

import pytest
from packaging.version import Version


# XLA's CPU compiler set for compile speed: the JAX tests compile about 1,200 programs, and
# XLA's backend compile is most of their time on 2 cores. LLVM at -O0 takes about a quarter
# off it, and XLA:CPU's earlier code generator (elemental IR emitters, in place of the
# MLIR fusion emitters) about half of the rest: on six JAX files, compile 267 s -> 199 s
# -> 103 s. Both compile the same optimized HLO (the HLO passes still run) with no
# fast-math, and the whole suite passes under either setting; only the machine code is
# less tuned. Set before JAX starts its CPU backend, and inherited by the processes
# the distributed tests start. A flag the caller set in XLA_FLAGS wins (e.g.
# XLA_FLAGS=--xla_cpu_use_fusion_emitters=true runs the suite on XLA's default emitters).
# XLA ends the process at an unknown flag, and jaxlib 0.11 no longer knows the emitters'
# (seen on 0.11.2 on a GPU machine, 2026-11-27: every JAX test's worker died): it is set
# only for the jaxlib versions that have it.
def _xla_test_flags() -> dict[str, str]:
    flags = {"xla_backend_optimization_level": "0"}
    try:
        jaxlib = Version(importlib.metadata.version("jaxlib"))
    except importlib.metadata.PackageNotFoundError:
        return flags
    if jaxlib.release < (0, 11):
        flags["xla_cpu_use_fusion_emitters"] = "false"
    return flags


_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags, *(f"--{k}={v}" for k, v in _xla_test_flags().items() if k not in _flags)]
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "in_program_kernel: needs JAX's in-program host kernel (tandv.track.jax._ffi); "
        "skipped where it cannot be built",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip an ``in_program_kernel`` test where that kernel cannot be built, asked when the
    test runs rather than at collection: on a cold numba cache the kernel's first build
    compiles for 11-31 s, and asked at collection every xdist worker paid it at the same
    time (both cores, before any test ran); asked here, one worker builds it and the other
    loads it from numba's cache."""
    if item.get_closest_marker("in_program_kernel") is not None:
        from tandv.track.jax import _ffi

        if not _ffi.available():
            pytest.skip("no in-program kernel on this machine")


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Every test runs in its own temporary directory, so default log folders
    (``tandv_logs/``) never land in the repository."""
    monkeypatch.chdir(tmp_path)


# The files that take longest on a 2-core machine (process groups, compiled programs),
# slowest first, from a run on cold caches as CI's (`pytest --junitxml` with NUMBA_CACHE_DIR
# and TRITON_CACHE_DIR empty, test times summed per file). `make test` runs the suite on
# pytest-xdist workers, a whole file at a time in collection order (--dist loadfile
# --no-loadscope-reorder): begun first, a long file does not keep one worker busy after the
# others have run out of files. The first two files start together, one on each worker:
# test_torch_fused.py (compiling the Triton kernels for sm_80 and sm_90, most of its time
# on a cold cache) needs no numba kernel, so the first JAX file's worker builds JAX's
# in-program kernel alone and the other worker loads it from numba's cache later. The rest
# keep their order after these; a name not found here orders nothing.
SLOW_FILES = (
    "test_torch_fused.py",
    "test_blocks_jax_paths.py",
    "test_jax_segments.py",
    "test_torch_tracker.py",
    "test_integrations.py",
    "test_distributed_jax.py",
    "test_jax_summary.py",
    "test_blocks_fused.py",
    "test_jax_tracker.py",
    "test_report.py",
    "test_docs_examples.py",
    "test_blocks.py",
    "test_jax_fastpath.py",
    "test_blocks_jax.py",
    "test_torch_summary.py",
    "test_viz_notebook.py",
    "test_jax_device_path.py",
    "test_jax_gpu_compile.py",
    "test_distributed_torch.py",
    "test_torch_compile.py",
    "test_host.py",
    "test_higher_moments_jax.py",
    "test_jax_transforms.py",
    "test_torch_host_cost.py",
    "test_jax_pallas_offsets.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files of ``SLOW_FILES`` first (a stable sort: each file's own order stays)."""
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FILES)))
