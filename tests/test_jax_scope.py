"""The readers of JAX's trace state (tandv/track/jax/_scope.py), run inside the real
transforms of the installed JAX.

They read JAX internals: the trace chain, the label JAX gives each traced body, its trace
classes. When a JAX release moves any of these, a test here fails with a message naming
the function to update, instead of taps silently misreading where they lie (a loop body's
mailbox written once per iteration, a ref closed over by a backward rule).
"""

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import tandv
from tandv.track.jax import _scope
from tandv.track.jax._scope import Scope, current_scope, is_batched, manual_keep, unbatched


def _update(function: str) -> str:
    return (
        f"jax {jax.__version__} moved what tandv/track/jax/_scope.py:{function}() reads "
        f"(verified with jax {_scope.VERIFIED_JAX}); update {function}() for this JAX"
    )


def scopes_in(run):
    """The scopes current_scope() reports at every trace of the body ``run`` runs (the body
    is the identity on the array it is given)."""
    seen = []

    def body(x):
        seen.append(current_scope())
        return x

    run(body)
    assert seen, "the transform never ran its body"
    return seen


x3 = jnp.arange(3.0)
CASES = {
    "eager": (lambda b: b(x3), Scope()),
    "jit": (lambda b: jax.jit(b)(x3), Scope()),
    "grad": (lambda b: jax.grad(lambda x: b(x).sum())(x3), Scope()),
    "scan": (
        lambda b: jax.lax.scan(lambda c, _: (b(c), None), x3, None, length=2),
        Scope(loop=True),
    ),
    "fori_loop, static bounds": (
        lambda b: jax.lax.fori_loop(0, 2, lambda i, c: b(c), x3),
        Scope(loop=True),
    ),
    "fori_loop, traced bounds": (
        lambda b: jax.jit(lambda n, x: jax.lax.fori_loop(0, n, lambda i, c: b(c), x))(2, x3),
        Scope(loop=True),
    ),
    "while_loop body": (
        lambda b: jax.lax.while_loop(lambda c: c[0] < 2, lambda c: b(c) + 1, x3),
        Scope(loop=True),
    ),
    "while_loop cond": (
        lambda b: jax.lax.while_loop(lambda c: b(c)[0] < 2, lambda c: c + 1, x3),
        Scope(loop=True),
    ),
    "checkpoint": (lambda b: jax.checkpoint(b)(x3), Scope(remat=True)),
    "checkpoint under grad": (
        lambda b: jax.grad(lambda x: jax.checkpoint(b)(x).sum())(x3),
        Scope(remat=True),
    ),
    "checkpoint in a scan body": (
        lambda b: jax.lax.scan(lambda c, _: (jax.checkpoint(b)(c), None), x3, None, length=2),
        Scope(loop=True, remat=True),
    ),
    "vmap": (lambda b: jax.vmap(b)(jnp.ones((2, 3))), Scope(batched=True)),
    "shard_map": (
        lambda b: jax.jit(
            jax.shard_map(
                b, mesh=Mesh(np.array(jax.devices()[:1]), ("d",)), in_specs=P(), out_specs=P()
            )
        )(x3),
        Scope(manual=True),
    ),
    "pmap": (lambda b: jax.pmap(b)(x3[None]), Scope(manual=True, pmap=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_current_scope_inside_each_transform(case):
    """Outside any transform, under jit and grad: nothing; inside scan, fori_loop (both
    lowerings), while_loop (body and cond): a loop; jax.checkpoint: remat; shard_map and
    pmap: manual; vmap: batched."""
    run, expected = CASES[case]
    seen = scopes_in(run)
    assert set(seen) == {expected}, f"{case}: got {set(seen)}, expected {expected}; " + _update(
        "current_scope"
    )


def test_current_scope_sees_the_restaged_remat_body_of_a_differentiated_scan():
    """nn.scan(nn.remat(...)) under grad: JAX stages the checkpointed body out again for
    partial evaluation; every trace of the body must read as a loop or a restaging (where a
    closed-over ref would be lost), and the partial-evaluation trace must be recognized."""
    seen = []

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            seen.append(current_scope())
            return nn.Dense(3)(c), None

    scan = nn.scan(
        nn.remat(Cell), variable_broadcast="params", split_rngs={"params": False}, length=2
    )
    x = jnp.ones((1, 3))
    params = scan().init(jax.random.key(0), x, None)
    seen.clear()
    jax.grad(lambda p: scan().apply(p, x, None)[0].sum())(params)
    assert seen
    message = f"got {set(seen)}; " + _update("current_scope")
    assert all(s.remat and (s.loop or s.restaged) for s in seen), message
    assert any(s.restaged for s in seen), message


def test_unbatched_gives_the_whole_batched_array_below_every_vmap():
    """Inside nested vmaps, unbatched(x) yields the full (batch, batch, n) array, and
    operations in its block run below the vmaps: the sum is of every element."""
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)
    got = []

    def body(x):
        assert is_batched(x), _update("is_batched")
        with unbatched(x) as whole:
            got.append((whole.shape, float(jnp.sum(whole))))
        return x

    jax.vmap(jax.vmap(body))(xs)
    assert got, _update("unbatched")
    shape, total = got[0]
    assert shape == xs.shape, _update("unbatched")
    assert total == pytest.approx(float(np.sum(np.asarray(xs, np.float64))), rel=1e-5)


def test_unbatched_leaves_other_values_alone():
    assert not is_batched(x3)
    with unbatched(x3) as whole:
        assert whole is x3

    def body(x):
        assert not is_batched(x), _update("is_batched")
        with unbatched(x) as whole:
            assert whole is x
        return x

    jax.jit(body)(x3)


def test_manual_keep_counts_a_replicated_value_once():
    """Inside shard_map over two devices: a value split over the mesh axis counts on both
    devices; a replicated one only on the device at index 0."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets jax_num_cpu_devices=2)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def local(split, replicated):
        return manual_keep(split)[None], manual_keep(replicated)[None]

    keep_split, keep_replicated = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P("d")))
    )(jnp.arange(4.0), jnp.arange(3.0))
    assert np.asarray(keep_split).tolist() == [True, True], _update("manual_keep")
    assert np.asarray(keep_replicated).tolist() == [True, False], _update("manual_keep")


def test_manual_keep_refuses_shard_map_without_varying_axes():
    """With check_vma=False a replicated value cannot be told from a split one (it would
    count once per device): refused, naming check_vma. pmap (which checks none either)
    counts every device."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets jax_num_cpu_devices=2)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def local(x):
        return manual_keep(x)[None]

    unchecked = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P("d"), check_vma=False)
    with pytest.raises(ValueError, match="check_vma=True"):
        jax.jit(unchecked)(jnp.arange(3.0))
    keep = jax.pmap(local, axis_name="d")(jnp.ones((2, 3)))
    assert np.asarray(keep).ravel().tolist() == [True, True], _update("manual_keep")


def test_scope_is_the_only_reader_of_jax_private_modules():
    package = Path(tandv.__file__).parent
    readers = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "jax._src" in p.read_text(encoding="utf-8")
    )
    assert readers == ["track/jax/_scope.py"]


def test_distributed_client_is_none_without_jax_distributed():
    assert _scope.distributed_client() is None
