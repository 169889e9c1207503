"""``benchmarks/jax_gpu_probe.py``: its counting of a compiled program's instructions, and
its tiny mode (a two-layer MLP), which prints each phase and the counts of every variant."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import jax_gpu_probe  # noqa: E402

#: A compiled module's text as XLA prints it: a fusion computation, then the entry.
HLO = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->(f32[4]{0}, s32[2]{0})}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %sine.0 = f32[4]{0} sine(f32[4]{0} %param_0)
}

ENTRY %main.9 (Arg_0.1: f32[4]) -> (f32[4], s32[2]) {
  %Arg_0.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %constant.2 = s32[2]{0} constant({1, 2})
  %sine_fusion = f32[4]{0} fusion(f32[4]{0} %Arg_0.1), kind=kLoop, calls=%fused_computation
  %cc.3 = (f32[4]{0}, s32[2]{0}) custom-call(f32[4]{0} %sine_fusion), custom_call_target="k"
  %get-tuple-element.4 = f32[4]{0} get-tuple-element(%cc.3), index=0
  %copy.5 = f32[4]{0} copy(f32[4]{0} %get-tuple-element.4)
  ROOT %tuple.6 = (f32[4]{0}, s32[2]{0}) tuple(f32[4]{0} %copy.5, s32[2]{0} %constant.2)
}
"""


def test_entry_instructions_counts_the_entry_computation_by_opcode():
    """The fusion's own body (a sine) is not counted; bookkeeping is, but launches none."""
    found = jax_gpu_probe.entry_instructions(HLO)
    assert found == {
        "parameter": 1,
        "constant": 1,
        "fusion": 1,
        "custom-call": 1,
        "get-tuple-element": 1,
        "copy": 1,
        "tuple": 1,
    }
    assert jax_gpu_probe.launches(found) == 3  # the fusion, the custom call, the copy


def test_tiny_mode_prints_each_phase_and_the_kernels_of_each_variant(monkeypatch, capsys):
    """On a two-layer MLP: every variant's timing lines, the tracked call split into
    dispatch and Python, and launch counts that grow with what is tracked: the output
    summaries add work to the untracked program, the taps more (compiled for the CPU, and
    lowered for CUDA)."""
    monkeypatch.setattr(
        sys,
        "argv",
        ["jax_gpu_probe.py", "--model", "mlp", "--width", "16", "--depth", "2"]
        + ["--batch", "8", "--steps", "2", "--profile", "3", "--cuda-ops"],
    )
    jax_gpu_probe.main()
    out = capsys.readouterr().out
    assert out.count("pipelined call returns") == 3 and out.count("idle      call") == 3, out
    assert out.count("= dispatch ") == 4, out  # the two tracked variants, in both modes
    assert "cProfile of one tracked call and step()" in out
    kernels = dict(re.findall(r"^kernels_(\w+): (\d+)$", out, re.M))
    cuda = dict(re.findall(r"cuda_kernels_(\w+): (\d+)$", out, re.M))
    for counted in (kernels, cuda):
        assert set(counted) == {"untracked", "tracked", "outputs"}, out
        n = {k: int(v) for k, v in counted.items()}
        assert n["untracked"] < n["outputs"] < n["tracked"], out
