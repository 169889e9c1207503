"""Compile the fused Triton kernels for CUDA GPUs on a machine without one, through the
real launch path, and print each compiled kernel's resources and static loop figures.

Run by ``tests/test_torch_fused.py`` in a subprocess without ``TRITON_INTERPRET`` (the
kernels are compiled, not interpreted) as ``python _triton_compile_worker.py ARCH
[ARCH ...]`` (one process for several architectures: each start imports torch and Triton
again); the last line of its output is JSON, each architecture's figures under its
number. ``launch_one`` and ``launch_many`` are called on CPU tensors, and Triton's
launcher, given a device of compute capability ARCH that compiles but never launches,
specializes and compiles each kernel exactly as it would for those arguments on a GPU
(argument types, 16-byte alignment, integers equal to 1). ``cuobjdump`` then gives each
cubin's registers (``-res-usage``: what ptxas wrote in it when Triton compiled) and its
machine code (``-sass``).

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

The block-format kernels (``_blocks_one``, ``_blocks_many``: a second read of a tensor
for the block-scaled formats' columns) are compiled too, in each variant ``launch_blocks``
and the batch path pick for float32 tensors (:data:`BLOCK_DTYPES`): every block format on
dense rows (vector loads) and on rows of 33 elements (read by their strides), NVFP4 alone
on dense rows (the summary kernel computed the MX formats in its pass). Their rows give
``kernel`` and ``formats``, their registers, instructions and the local-memory (spill)
instructions anywhere in their code; they have no tile-loop figures.

With ``--table`` it also prints the figures as a table (for docs/cost-torch.md), with the
spill bytes ptxas reports when it assembles each kernel's PTX again (``ptxas -v``; a
second assembly, not needed for the test's figures).
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

from tandv.stats.blocks import block_extras
from tandv.stats.summary import Layout
from tandv.track.torch import _fused

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,  # the other 8-bit formats compile the same code
    torch.float64,
)
#: the dtypes whose block kernels are compiled: float32 only (each dtype adds about 13 s of
#: compilation to the suite on a cold cache; the other dtypes' loads are the summary
#: kernels', compiled above, and a block kernel's code after its load is the same)
BLOCK_DTYPES = (torch.float32,)


class CompileOnlyDevice:
    """What Triton's launcher asks of the active driver before it compiles, for a GPU of
    compute capability ``arch``."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

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


def spills(ptx: str, arch: int) -> dict[str, int]:
    """Spill bytes of ``ptx`` assembled again for ``arch`` (``ptxas -v``; for the table)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        run = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        )
    text = run.stdout + run.stderr
    return {
        "spill_stores": int(re.findall(r"(\d+) bytes spill stores", text)[-1]),
        "spill_loads": int(re.findall(r"(\d+) bytes spill loads", text)[-1]),
    }


def disassemble(cubin: bytes) -> tuple[int, list[tuple[int, str]]]:
    """The registers per thread ptxas recorded in ``cubin``, and the ``(address,
    instruction)`` of each of its SASS instructions (one ``cuobjdump``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", "-sass", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers = re.search(r"\bREG:(\d+)", text)
    assert registers is not None, "cuobjdump -res-usage printed no REG"
    code = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and not m.group(2).startswith("NOP"):
            code.append((int(m.group(1), 16), m.group(2)))
    return int(registers.group(1)), code


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
    registers, code = disassemble(compiled.asm["cubin"])
    loop = steady_loop(code)
    per_warp = 32 * kwargs["K"] * kwargs["VEC"]
    return {
        "kernel": name,
        "strided": bool(kwargs.get("STRIDED", False)),
        "registers": registers,
        "ptx_v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.", ptx)),
        "loop_instructions": len(loop),
        "loop_128bit_loads": sum("LDG.E.128" in t for t in loop),
        "loop_spill_instructions": sum(map(_spill, loop)),
        "elements_per_warp_per_tile": per_warp,
        "instructions_per_element": round(len(loop) / per_warp, 3),
        # how Triton lowered tl.histogram (see the module notes)
        "histogram": (
            "ballots"
            if any("VOTE.ANY" in t for t in loop)
            else "shared atomics"
            if any("ATOMS" in t for t in loop)
            else "none"
        ),
    }


def _spill(instruction: str) -> bool:
    """Whether a SASS instruction reads or writes local memory (``STL``, ``LDL`` and their
    variants such as ``STL.64`` or ``LDL.LU``, predicated or not): spill traffic."""
    return re.search(r"\b(STL|LDL)\b", instruction) is not None


def block_figures(name: str, compiled: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A compiled block kernel's resources: registers, instructions (``NOP`` aside) and
    local-memory loads and stores (spills) anywhere in its code."""
    registers, code = disassemble(compiled.asm["cubin"])
    columns = ("C_E4M3", "C_E5M2", "C_E2M1", "C_NV")
    formats = [f for f, c in zip(_fused._BLOCK_KERNEL_FORMATS, columns) if kwargs[c]]
    return {
        "kernel": name,
        "formats": "+".join(formats),
        "strided": not kwargs["DENSE"],
        "registers": registers,
        "instructions": len(code),
        "spill_instructions": sum(_spill(t) for _, t in code),
    }


def launch_block_variants(dtype: torch.dtype) -> None:
    """Launch the block kernels (see the module notes) as ``launch_blocks`` and the batch
    path (``_launch_blocks_many``) do for ``dtype``'s tensors with every block format."""
    spec = _fused.spec_for(dtype)
    layout = Layout(str(dtype).removeprefix("torch."), block_extras(_fused._BLOCK_KERNEL_FORMATS))
    rows = torch.zeros(_fused.row_size(spec, layout), dtype=torch.float64)
    dense, ragged = torch.zeros(8, 64, dtype=dtype), torch.zeros(8, 33, dtype=dtype)
    for x, mx_done in ((dense, False), (ragged, False), (dense, True)):
        _fused.launch_blocks(x, spec, layout, rows, 0, 16, mx_done=mx_done)
        flat = x.view(torch.uint8) if spec.mode == 3 else x  # (as launch_many passes it)
        _fused._launch_blocks_many([flat, flat], spec, layout, rows, [0, 0], 16, mx_done, 0)


def compile_all(arch: int, table: bool) -> list[dict[str, Any]]:
    """The figures of every kernel variant compiled for ``arch`` (with ``table``, ptxas's
    spill bytes too)."""
    driver.set_active(CompileOnlyDevice(arch))
    built: list[tuple[str, Any, dict[str, Any]]] = []
    names = ("_summarize_one", "_summarize_many", "_blocks_one", "_blocks_many")
    kernels = {name: getattr(_fused, name) for name in names}
    for name, kernel in kernels.items():
        kernel.device_caches.clear()  # each device's cache holds the target it compiles for
        setattr(_fused, name, CompileOnly(kernel, built))
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

    def collect(dtype: torch.dtype, moments: int, figures_of: Any) -> None:
        """The rows of the kernels built since the last call (``figures_of``: their figures)."""
        assert len(checked) == len(built) and all(checked), "launcher arguments differ"
        for name, compiled, kwargs in built:
            row = {"dtype": str(dtype), "moments": moments, **figures_of(name, compiled, kwargs)}
            if table:
                row |= spills(compiled.asm["ptx"], arch)
            report.append(row)
        built.clear()
        checked.clear()

    try:
        # every dtype with the default moments; float32 also with moments=4 (m3, m4 too)
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
            collect(dtype, moments, figures)
        for dtype in BLOCK_DTYPES:
            launch_block_variants(dtype)
            collect(dtype, 2, block_figures)
    finally:
        _fused._launch = launch
        for name, kernel in kernels.items():
            setattr(_fused, name, kernel)
    return report


def print_table(arch: int, report: list[dict[str, Any]]) -> None:
    print(f"sm_{arch}, Triton {triton.__version__}: kernel, dtype: registers, spill bytes,")
    print("PTX v4 loads, loop 128-bit", end=" ")
    print("loads, loop instructions / elements per warp = instructions per element")
    for r in report:
        if "formats" in r:  # a block kernel
            print(
                f"{r['kernel'] + (' (strided)' if r['strided'] else ''):30s} "
                f"{r['dtype'] + ' ' + r['formats']:30s} {r['registers']:4d} "
                f"{r['spill_stores']:4d} (instructions: {r['instructions']})"
            )
            continue
        print(
            f"{r['kernel'] + (' (strided)' if r['strided'] else ''):30s} "
            f"{r['dtype'] + (' moments=4' if r['moments'] == 4 else ''):30s} "
            f"{r['registers']:4d} {r['spill_stores']:4d} {r['ptx_v4_loads']:3d} "
            f"{r['loop_128bit_loads']:3d} {r['loop_instructions']:5d} / "
            f"{r['elements_per_warp_per_tile']:4d} = {r['instructions_per_element']:.3f}"
        )


def main() -> None:
    assert not _fused.INTERPRETED, "run without TRITON_INTERPRET"
    table = "--table" in sys.argv
    archs = [int(a) for a in sys.argv[1:] if a != "--table"]
    if not archs:
        raise SystemExit("usage: python _triton_compile_worker.py ARCH [ARCH ...] [--table]")
    reports = {}
    for arch in archs:
        reports[str(arch)] = compile_all(arch, table)
        if table:
            print_table(arch, reports[str(arch)])
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
