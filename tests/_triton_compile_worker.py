"""Compile the fused Triton kernels for a CUDA GPU on a machine without one, through the
real launch path, and print each compiled kernel's resources and static loop figures.

Run by ``tests/test_torch_fused.py`` in a subprocess without ``TRITON_INTERPRET`` (the
kernels are compiled, not interpreted) as ``python _triton_compile_worker.py ARCH``; the
last line of its output is JSON. ``launch_one`` and ``launch_many`` are called on CPU
tensors, and Triton's launcher, given a device of compute capability ARCH that compiles
but never launches, specializes and compiles each kernel exactly as it would for those
arguments on a GPU (argument types, 16-byte alignment, integers equal to 1). ptxas then
reports registers and spills of each cubin, and ``cuobjdump -sass`` gives its machine
code.

How the steady-state figure is counted
--------------------------------------
The *steady-state loop* is the loop over a program's whole tiles: in the SASS, the span
from the target of a backward branch to that branch, for the backward branch whose span
holds both loads of the tensor (``LDG``, but not the ``.STRONG`` volatile loads of the
partial rows the last program merges) and float64 adds (``DADD``: each tile's moments
merged into the slots'), the first such span in the code: the compiler lays the tile
loop out first, and the spans after it that hold both are jumps across the merge of the
partial rows (they hold its ``.STRONG`` loads, which the tile loop must not); the second
read of a program with outliers (``_all_counts``) only counts. This holds under both of
Triton's lowerings of ``tl.histogram`` (shared-memory atomics, Triton 3.9:
``ATOMS.POPC.INC``; warp ballots and popcounts, Triton 3.6: ``VOTE.ANY``, ``POPC``).
Every instruction in the span but ``NOP`` counts once: the loop has no inner loop, and
its only forward branches skip a few instructions (the window's anchoring, a reduction
across the program taken once, about 30 instructions counted here though skipped in the
steady state), so this is the number of warp instructions a warp issues per tile, an
upper bound. One tile gives each warp
``32 * K * VEC`` elements, so ``instructions_per_element = loop_instructions / (32 * K
* VEC)``. The loop's 128-bit loads (``LDG.E.128``) and any spill traffic in it
(``STL``/``LDL``) are counted in the same span.

With ``--table`` it prints the figures as a table instead (for docs/cost-torch.md).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime import driver

from tandv.stats.summary import Layout
from tandv.track.torch import _fused

ARCH = int(sys.argv[1])
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,  # the other 8-bit formats compile the same code
    torch.float64,
)


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

    def __init__(self, kernel: Any, built: list[tuple[str, Any, dict[str, Any]]]) -> None:
        self.kernel, self.built = kernel, built

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def compile_for(*args: Any, **kwargs: Any) -> None:
            compiled = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
            self.built.append((self.kernel.__name__, compiled, kwargs))

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


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, instruction)`` of each SASS instruction of ``cubin`` (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and not m.group(2).startswith("NOP"):
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def steady_loop(code: list[tuple[int, str]]) -> list[str]:
    """The instructions of the loop over whole tiles (see the module notes)."""
    loops = []
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", text)
        if m and int(m.group(1), 16) <= addr:
            body = [t for a, t in code if int(m.group(1), 16) <= a <= addr]
            reads = any("LDG" in t and ".STRONG" not in t for t in body)
            if reads and any(re.search(r"\bDADD\b", t) for t in body):
                loops.append((int(m.group(1), 16), body))
    assert loops, "found no tile loop"
    first = min(loops, key=lambda loop: loop[0])[1]
    assert not any(".STRONG" in t for t in first), "the first loop reads partial rows"
    return first


def figures(name: str, compiled: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A compiled kernel's resources, vector loads and steady-state loop figures."""
    ptx = compiled.asm["ptx"]
    loop = steady_loop(sass(compiled.asm["cubin"]))
    per_warp = 32 * kwargs["K"] * kwargs["VEC"]
    return {
        "kernel": name,
        "strided": bool(kwargs.get("STRIDED", False)),
        **resources(ptx),
        "ptx_v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.", ptx)),
        "loop_instructions": len(loop),
        "loop_128bit_loads": sum("LDG.E.128" in t for t in loop),
        "loop_spill_instructions": sum(t.split()[0] in ("STL", "LDL") or "LDL." in t for t in loop),
        "elements_per_warp_per_tile": per_warp,
        "instructions_per_element": round(len(loop) / per_warp, 3),
    }


def main() -> None:
    assert not _fused.INTERPRETED, "run without TRITON_INTERPRET"
    driver.set_active(CompileOnlyDevice())
    built: list[tuple[str, Any, dict[str, Any]]] = []
    _fused._summarize_one = CompileOnly(_fused._summarize_one, built)
    _fused._summarize_many = CompileOnly(_fused._summarize_many, built)
    launch, checked = _fused._launch, []

    def launch_checked(kernel: Any, programs: int, args: Any, consts: Any, ptrs: Any) -> None:
        """The prebuilt launchers' argument list equals what Triton's binder makes."""
        binder = kernel.kernel.device_caches[0][4]
        bound = tuple(binder(*args, **consts.kwargs)[0].values())
        full = (*args, *consts.tail)
        checked.append(
            len(bound) == len(full)
            and all(
                a is b or (not isinstance(a, torch.Tensor) and a == b) for a, b in zip(bound, full)
            )
        )
        launch(kernel, programs, args, consts, ptrs)

    _fused._launch = launch_checked
    report = []
    # every dtype with the default moments; float32 also with moments=4 (m3, m4 in the pass)
    for dtype, moments in [*((d, 2) for d in DTYPES), (torch.float32, 4)]:
        spec = _fused.spec_for(dtype)
        layout = Layout(str(dtype).removeprefix("torch."), moments=moments)
        size = _fused.row_size(spec, layout)
        rows = torch.zeros(3 * size, dtype=torch.float64)
        scratch = torch.zeros(16 * _fused.PART, dtype=torch.float64)
        # one program, and several programs merging their partial rows (16-byte aligned)
        n_big = (_fused.ONE_PROGRAM + 3) * spec.block + 5
        tensors = [torch.zeros(n, dtype=dtype) for n in (1000, n_big)]
        _fused.launch_one(tensors[1], spec, layout, rows, 2 * size, scratch, 16)
        _fused.launch_many(tensors, spec, layout, rows, [0, size], lambda k, s=scratch: s, 16)
        if dtype == torch.float32 and moments == 2:  # a gappy view, read by its strides
            gappy = torch.zeros(64, 3 * spec.block)[:, ::3]
            _fused.launch_one(gappy, spec, layout, rows, 0, scratch, 16)
        assert len(checked) == len(built) and all(checked), "launcher arguments differ"
        for name, compiled, kwargs in built:
            report.append(
                {"dtype": str(dtype), "moments": moments, **figures(name, compiled, kwargs)}
            )
        built.clear()
        checked.clear()
    if "--table" in sys.argv:
        print(f"sm_{ARCH}, Triton {triton.__version__}: kernel, dtype: registers, spill bytes,")
        print("PTX v4 loads, loop 128-bit", end=" ")
        print("loads, loop instructions / elements per warp = instructions per element")
        for r in report:
            print(
                f"{r['kernel'] + (' (strided)' if r['strided'] else ''):30s} "
                f"{r['dtype'] + (' moments=4' if r['moments'] == 4 else ''):30s} "
                f"{r['registers']:4d} {r['spill_stores']:4d} {r['ptx_v4_loads']:3d} "
                f"{r['loop_128bit_loads']:3d} {r['loop_instructions']:5d} / "
                f"{r['elements_per_warp_per_tile']:4d} = {r['instructions_per_element']:.3f}"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
