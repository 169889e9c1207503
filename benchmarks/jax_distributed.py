"""Cost of the JAX tracker's per-step exchange in a 2-process ``jax.distributed`` run on CPU.

Run ``python benchmarks/jax_distributed.py`` (it starts its two processes itself). Each
process trains a data-parallel MLP (batch sharded over the two processes' devices,
parameters replicated) for ``STEPS`` steps without tandv and then with it (every step
tracked), and reports the median step time of each and the time ``tracker.step()``
spends in the exchange of summaries (process 1 sends; process 0 waits for and receives
process 1's rows, merges happen after)."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

STEPS, WIDTH, BATCH = 30, 512, 256


def child(process_id: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id, shutdown_timeout_seconds=10)
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tandv.track.common.distributed import RankMerger
    from tandv.track.jax import track

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.relu(nn.Dense(WIDTH)(x))
            return nn.Dense(10)(x)

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(0)
    x_host = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    y_host = rng.normal(size=(BATCH, 10)).astype(np.float32)

    def put(v, spec):
        return jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i: v[i])

    x, y = put(x_host, P("d")), put(y_host, P("d"))
    model, opt = MLP(), optax.adam(1e-3)
    params = jax.tree.map(lambda a: put(np.asarray(a), P()), model.init(jax.random.key(0), x_host))
    state = opt.init(params)

    @jax.jit
    def update(params, state, x, y):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, grads

    plain = []
    for _ in range(STEPS):
        start = time.perf_counter()
        params, state, grads = update(params, state, x, y)
        jax.block_until_ready(params)
        plain.append(time.perf_counter() - start)
    tracked = []
    merge_seconds: list[float] = []
    original = RankMerger.merge

    def timed_merge(self, step, entries):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return original(self, step, entries)
        finally:
            merge_seconds.append(time.perf_counter() - start)

    RankMerger.merge = timed_merge  # type: ignore[method-assign]
    with track(params, state, out=out, verbose=False) as tracker:
        for _ in range(STEPS):
            start = time.perf_counter()
            params, state, grads = tracker.intercept(update, params, state, x, y)
            tracker.step(params, state, grads)
            jax.block_until_ready(params)
            tracked.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(merge_seconds[5:] or merge_seconds)
    print(
        f"process {process_id}: step {1e3 * statistics.median(plain[5:]):.1f} ms untracked, "
        f"{1e3 * statistics.median(tracked[5:]):.1f} ms tracked; exchange {ms:.2f} ms/step",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tempfile.mkdtemp(), "log")
        procs = [
            subprocess.Popen([sys.executable, __file__, str(i), str(port), out]) for i in range(2)
        ]
        sys.exit(max(p.wait() for p in procs))
