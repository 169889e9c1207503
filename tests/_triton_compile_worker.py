"""Compile the fused Triton kernels for a CUDA GPU on a machine without one, through the
real launch path, and print each compiled kernel's resources as JSON.

Run by ``tests/test_torch_fused.py`` in a subprocess without ``TRITON_INTERPRET`` (the
kernels are compiled, not interpreted) as ``python _triton_compile_worker.py ARCH``:
``launch_one`` and ``launch_many`` are called on CPU tensors, and Triton's launcher, given a
device of compute capability ARCH that compiles but never launches, specializes and compiles
each kernel exactly as it would for those arguments on a GPU (argument types, 16-byte
alignment, integers equal to 1). ptxas then reports registers and spills of each cubin.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime import driver

from tandv.stats.summary import Layout
from tandv.track.torch import _fused

ARCH = int(sys.argv[1])
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


class CompileOnlyDevice:
    """What Triton's launcher asks of the active driver before it compiles."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", ARCH, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


class CompileOnly:
    """Stands for a kernel in ``_fused``: ``kernel[grid](*args)`` compiles, never launches."""

    def __init__(self, kernel: Any, built: list[tuple[str, Any]]) -> None:
        self.kernel, self.built = kernel, built

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def compile_for(*args: Any, **kwargs: Any) -> None:
            compiled = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
            self.built.append((self.kernel.__name__, compiled))

        return compile_for


def resources(ptx: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes of ``ptx`` assembled for ``ARCH`` (ptxas -v)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        arch = f"sm_{ARCH}a" if ARCH >= 90 else f"sm_{ARCH}"
        run = subprocess.run(
            [get_ptxas(ARCH).path, "-v", f"--gpu-name={arch}", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        )
    text = run.stdout + run.stderr

    def last(pattern: str) -> int:
        return int(re.findall(pattern, text)[-1])

    return {
        "registers": last(r"Used (\d+) registers"),
        "stack": last(r"(\d+) bytes stack frame"),
        "spill_stores": last(r"(\d+) bytes spill stores"),
        "spill_loads": last(r"(\d+) bytes spill loads"),
    }


def main() -> None:
    assert not _fused.INTERPRETED, "run without TRITON_INTERPRET"
    driver.set_active(CompileOnlyDevice())
    built: list[tuple[str, Any]] = []
    _fused._summarize_one = CompileOnly(_fused._summarize_one, built)
    _fused._summarize_many = CompileOnly(_fused._summarize_many, built)
    report = []
    for dtype in DTYPES:
        spec = _fused.spec_for(dtype)
        layout = Layout(str(dtype).removeprefix("torch."))
        size = _fused.row_size(spec, layout)
        rows = torch.zeros(3 * size, dtype=torch.float64)
        scratch = torch.zeros(16 * _fused.PART, dtype=torch.float64)
        # one program, and several programs merging their partial rows
        tensors = [torch.zeros(n, dtype=dtype) for n in (1000, 3 * _fused.MIN_CHUNK + 5)]
        _fused.launch_one(tensors[1], spec, layout, rows, 2 * size, scratch, 16)
        _fused.launch_many(tensors, spec, layout, rows, [0, size], lambda k, s=scratch: s, 16)
        for name, compiled in built:
            report.append({"dtype": str(dtype), "kernel": name, **resources(compiled.asm["ptx"])})
        built.clear()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
