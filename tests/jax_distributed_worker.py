"""One process of the distributed JAX tests (tests/test_distributed_jax.py): a small MLP
trained a few steps under ``tandv.track.jax.track``, its batch (``dp``) or its parameters
too (``fsdp``) sharded over every device of the run, or its batch split by a
``shard_map`` update that sums the gradients itself (``shard_map``), or unsharded on one
device (``none``: the reference run over the same global batch).

Run as ``python jax_distributed_worker.py RUNS OUT DEVICES [PROCESSES PROCESS_ID PORT]``.
RUNS is a comma-separated list of runs made one after the other in this process (each
start of JAX costs seconds of imports), each a MODE, or ``MODE:PATH`` to summarize on the
summary path PATH (``TANDV_JAX_SUMMARY``'s values). Run ``R`` (``:`` written ``-``) logs to
``OUT/R``; with OUT ``-`` it logs to the default path, in the folder ``R`` of the working
directory. Before each run the process prints ``tandv-worker ID: run R``, so that a
reader can split its output by run. With PROCESSES > 1 the process joins a
``jax.distributed`` run on 127.0.0.1:PORT with DEVICES CPU devices. With the environment
variable ``DIE_AT=k``, process 1 stops at step k before calling ``tracker.step()`` and
exits once process 0 has raised (a process that hangs, then dies; process 0 marks its
uncaught error with the file ``DIED_MARK``, and process 1 waits at most 90 s for it, so a
slow, loaded machine cannot make process 1 die before process 0 has timed out);
``DIST_TIMEOUT`` is the tracker's ``dist_timeout``. The values are small multiples of
1/8, so every matmul and reduction of the step is exact in float32: the sharded and
unsharded runs compute the same bits, and their logs can be compared exactly."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax

RUNS, OUT, DEVICES = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
PROCESSES, PROCESS_ID, PORT = (int(a) for a in sys.argv[4:7]) if len(sys.argv) > 4 else (1, 0, 0)
STEPS = 3
DIE_AT = int(os.environ.get("DIE_AT", "-1"))
DIED_MARK = os.environ.get("DIED_MARK", "")

if DIED_MARK and PROCESS_ID == 0:
    _excepthook = sys.excepthook

    def _mark_then_report(*exc_info):  # (runs before JAX's shutdown barrier at exit)
        open(DIED_MARK, "w").close()
        _excepthook(*exc_info)

    sys.excepthook = _mark_then_report

jax.config.update("jax_num_cpu_devices", DEVICES)
if PROCESSES > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{PORT}",
        num_processes=PROCESSES,
        process_id=PROCESS_ID,
        initialization_timeout=60,
        # with DIE_AT, process 0's shutdown barrier at exit waits for a process that is
        # gone (it can only time out): a short wait ends the run sooner
        shutdown_timeout_seconds=2 if DIE_AT >= 0 else 10,
    )

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tandv.track.common.distributed import RankMerger  # noqa: E402
from tandv.track.jax import track  # noqa: E402
from tandv.track.jax._kernels import summary_path  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(h)


def dyadic(rng, shape, scale=8):
    return (rng.integers(-4, 5, size=shape) / scale).astype(np.float32)


rng = np.random.default_rng(0)
host_params = {
    "params": {
        "Dense_0": {"kernel": dyadic(rng, (8, 16)), "bias": dyadic(rng, (16,))},
        "Dense_1": {"kernel": dyadic(rng, (16, 4)), "bias": dyadic(rng, (4,))},
    }
}
host_batches = [(dyadic(rng, (16, 8), 2), dyadic(rng, (16, 4), 2)) for _ in range(STEPS)]
# learning rate 0: the parameters stay multiples of 1/8 (an update would make their
# products round differently in a sharded matmul); gradients and momentum still change
model, opt = MLP(), optax.sgd(0.0, momentum=0.5)


def update(params, state, x, y):
    def loss(p):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads, value


def local_update(params, state, x, y):
    """``update`` on this device's part of the batch (the gradients of the replicated
    parameters come out summed over the mesh: JAX's transpose of their broadcast)."""

    def loss(p):
        return jnp.sum((model.apply(p, x) - y) ** 2) / host_batches[0][1].size

    value, grads = jax.value_and_grad(loss)(params)
    value = jax.lax.psum(value, "d")
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads, value


merge_seconds: list[float] = []
_merge = RankMerger.merge


def timed_merge(self, step, entries):  # the exchange's cost, for the run's report
    start = time.perf_counter()
    try:
        return _merge(self, step, entries)
    finally:
        merge_seconds.append(time.perf_counter() - start)


RankMerger.merge = timed_merge


def placed(mode: str):
    """The parameters, the optimizer state, the step's update and the batch's placement
    of ``mode``."""
    if mode == "none":
        params = jax.tree.map(jnp.asarray, host_params)
        return params, opt.init(params), jax.jit(update), jnp.asarray
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def put(value, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])

    params = jax.tree.map(lambda v: put(v, P("d") if mode == "fsdp" else P()), host_params)
    state = opt.init(params)
    if mode == "shard_map":
        step = jax.jit(
            jax.shard_map(
                local_update,
                mesh=mesh,
                in_specs=(P(), P(), P("d"), P("d")),
                out_specs=(P(), P(), P(), P()),
            )
        )
    else:
        shardings = jax.tree.map(lambda a: a.sharding, (params, state))
        step = jax.jit(update, out_shardings=(shardings[0], shardings[1], shardings[0], None))
    return params, state, step, lambda value: put(value, P("d"))


def run(mode: str, out: str | None) -> None:
    """``STEPS`` tracked steps of ``mode`` logged to ``out`` (None: the default path)."""
    params, state, step, put_batch = placed(mode)
    times = []
    merge_seconds.clear()
    with track(
        params,
        state,
        out=out,
        verbose=True,
        dist_timeout=float(os.environ.get("DIST_TIMEOUT", "600")),
    ) as tracker:
        print(f"tandv-worker {PROCESS_ID}: out_path {tracker.out_path}", flush=True)
        for k, (x, y) in enumerate(host_batches):
            start = time.perf_counter()
            params, state, grads, loss = tracker.intercept(
                step, params, state, put_batch(x), put_batch(y)
            )
            if k == DIE_AT and PROCESS_ID == 1:
                # stop stepping (hung, as a process stuck elsewhere is), then die: process 0
                # must give up waiting for this process's summaries on its own
                deadline = time.monotonic() + 90
                while not os.path.exists(DIED_MARK) and time.monotonic() < deadline:
                    time.sleep(0.2)
                os._exit(3)
            tracker.log_scalars(loss=loss)
            tracker.step(params, state, grads)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - start)
    exchange = (
        f"; exchange {sum(merge_seconds) / len(merge_seconds) * 1e3:.1f} ms/step"
        if merge_seconds
        else ""
    )
    steps = [round(t * 1e3, 1) for t in times]
    print(f"tandv-worker {PROCESS_ID}: steps {steps} ms{exchange}", flush=True)


home = Path.cwd()
for name in RUNS:
    mode, _, path = name.partition(":")
    folder = name.replace(":", "-")
    print(f"tandv-worker {PROCESS_ID}: run {folder}", flush=True)
    with summary_path(path or "auto"):
        if OUT == "-":
            (home / folder).mkdir(exist_ok=True)  # both processes share the folder
            os.chdir(home / folder)
            run(mode, None)
            os.chdir(home)
        else:
            run(mode, str(Path(OUT) / folder))
