"""The suite's own setup (``tests/conftest.py``): the XLA flags it sets for compile speed."""

import importlib.metadata

import conftest
import pytest


@pytest.mark.parametrize(
    "jaxlib, emitters",
    [("0.10.2", True), ("0.10.0rc1", True), ("0.11.0", False), ("0.11.2", False), (None, False)],
)
def test_the_emitters_flag_only_for_jaxlib_that_knows_it(monkeypatch, jaxlib, emitters):
    """XLA ends the process at a flag it does not know, and jaxlib 0.11 dropped
    ``xla_cpu_use_fusion_emitters``: set for earlier jaxlib only; without jaxlib, the
    optimization level alone."""

    def version(name):
        assert name == "jaxlib"
        if jaxlib is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return jaxlib

    monkeypatch.setattr(importlib.metadata, "version", version)
    flags = conftest._xla_test_flags()
    assert flags["xla_backend_optimization_level"] == "0"
    assert ("xla_cpu_use_fusion_emitters" in flags) is emitters
