"""Overhead of the JAX tracker on a jitted Flax MLP update (CPU by default).

Runs blocks of training steps without tracking, tracking everything every step, and
tracking everything every 10th step, interleaved round by round so that machine noise hits
all three alike, and reports each tracked variant's median block time over the untracked one.

    python benchmarks/jax_overhead.py [--width 512] [--depth 4] [--batch 256] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tandv.track.jax import track  # noqa: E402


class MLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--block", type=int, default=20, help="steps per timed block (a multiple of 10)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    model, opt = MLP(args.width, args.depth), optax.adam(1e-3)
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.batch, args.width))
    y = jax.random.normal(ky, (args.batch, 1))
    params = model.init(kp, x)
    state = opt.init(params)
    n_params = sum(a.size for a in jax.tree.leaves(params))

    @jax.jit
    def update(p, s, x, y):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, grads

    with tempfile.TemporaryDirectory() as tmp:
        t1 = track(params, state, out=Path(tmp) / "every1", verbose=False)
        t10 = track(params, state, out=Path(tmp) / "every10", every=10, verbose=False)
        variants = {"untracked": None, "every=1": t1, "every=10": t10}
        carry = {name: (params, state) for name in variants}

        def block(name: str) -> float:
            tracker = variants[name]
            p, s = carry[name]
            start = time.perf_counter()
            for _ in range(args.block):
                if tracker is None:
                    p, s, g = update(p, s, x, y)
                else:
                    p, s, g = tracker.intercept(update, p, s, x, y)
                    tracker.step(p, s, g)
            jax.block_until_ready(p)
            carry[name] = (p, s)
            return time.perf_counter() - start

        for name in variants:  # warm-up: compile every version
            block(name)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name in variants:
                times[name].append(block(name))
        t1.close()
        t10.close()

    base = statistics.median(times["untracked"])
    print(f"jitted Flax MLP update: width {args.width}, depth {args.depth}, batch {args.batch}, "
          f"{n_params:,} parameters, adam; {jax.devices()[0].platform}, "
          f"{args.rounds} interleaved rounds of {args.block} steps")
    print(f"  untracked  median step {1e3 * base / args.block:8.3f} ms")
    for name in ("every=1", "every=10"):
        med = statistics.median(times[name])
        print(f"  {name:9s}  median step {1e3 * med / args.block:8.3f} ms   ratio of medians {med / base:.3f}")


if __name__ == "__main__":
    main()
