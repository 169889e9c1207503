"""The JAX demo run (`tandv demo --framework jax`) on a one-block model for speed."""

import pytest

pytest.importorskip("flax")

from tandv.demos.jax_demo import run  # noqa: E402
from tandv.schema import read_log, read_scalars  # noqa: E402


def test_jax_demo_writes_a_log_with_every_tensor_type(tmp_path):
    path = run(steps=3, out=tmp_path / "demo", seed=1, depth=1)
    assert path == tmp_path / "demo"
    df = read_log(path)
    m = df["metadata"]
    assert sorted(m["step"].unique()) == [0, 1, 2]
    assert set(m["tensor_type"]) == {"Activation", "Gradient", "Weight", "Optimiser_State"}
    step0 = set(m["name"][m["step"] == 0])
    assert {
        "layers_0.attn.query.kernel",
        "layers_0.attn.query.kernel.mu",
        "embed.embedding",
        "pos_embedding",
        "layers_0.attn",
        "head",
        "root",
        "head.kernel.update",
    } <= step0
    scalars = read_scalars(path)
    assert scalars["step"].tolist() == [0, 1, 2] and (scalars["loss"] > 0).all()
    with pytest.raises(ValueError, match="steps=0"):
        run(steps=0, out=tmp_path / "bad")
