"""Per-call cost of a train step written with ``nnx.jit`` + ``nnx.grad``.

The model is dispatch-bound on purpose (16 ``Linear(16, 16)`` layers, batch
8): the math takes microseconds, so what is measured is the Python work each
lifted transform does around the compiled step. Three versions of the same
step (forward, MSE loss, backward, SGD update) run side by side:

* ``jax.jit``: hand-written, parameters as a list of ``(w, b)`` arrays, the
  baseline every ratio is relative to;
* ``nnx.jit``: the Module passed directly, state written back after the call;
* ``flax.nnx.jit``: the same with flax, when flax is installed.

Run: ``python benchmarks/transforms.py [--layers 16] [--calls 2000]``.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import nnx

LEARNING_RATE = 0.01


class MLP(nnx.Module):
    def __init__(self, layers: int, features: int, *, ctx: nnx.Context):
        self.layers = nnx.Sequence([nnx.Linear(features, features, ctx=ctx) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def make_nnx_step():

    @nnx.jit
    def train_step(model: MLP, x, y):

        def loss_fn(model: MLP):
            return jnp.mean((model(x) - y) ** 2)

        grads = nnx.grad(loss_fn)(model)
        params = model.filter(nnx.Param)
        model.update_state(jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads))

    return train_step


def make_jax_step():

    def forward(params, x):
        for w, b in params:
            x = jax.nn.relu(x @ w + b)
        return x

    @jax.jit
    def train_step(params, x, y):

        def loss_fn(params):
            return jnp.mean((forward(params, x) - y) ** 2)

        grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    return train_step


def make_flax_step(layers: int, features: int):
    from flax import nnx as fnnx

    class FlaxMLP(fnnx.Module):
        def __init__(self, rngs):
            self.layers = fnnx.List([fnnx.Linear(features, features, rngs=rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    model = FlaxMLP(fnnx.Rngs(0))

    @fnnx.jit
    def train_step(model, x, y):

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        grads = fnnx.grad(loss_fn)(model)
        params = fnnx.state(model, fnnx.Param)
        fnnx.update(model, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads))

    return model, train_step


def time_interleaved(variants: dict, calls: int, repeats: int) -> dict:
    """Median seconds per call of each ``(step, sync)`` variant.

    The variants take turns within every repeat, so a slow stretch of the
    machine (other processes) hits all of them alike and the ratios hold.
    """
    for step, sync in variants.values():
        step()
        step()
        sync()  # compile (and settle the input types) outside the timing
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (step, sync) in variants.items():
            n = calls[name] if isinstance(calls, dict) else calls
            start = time.perf_counter()
            for _ in range(n):
                step()
            sync()
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(times) for name, times in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    x = jnp.ones((args.batch, args.features))
    y = jnp.zeros((args.batch, args.features))
    variants, calls = {}, {}

    jax_step = make_jax_step()
    init = MLP(args.layers, args.features, ctx=nnx.context(0))
    box = {"params": [(layer.kernel, layer.bias) for layer in init.layers]}

    def run_jax():
        box["params"] = jax_step(box["params"], x, y)

    variants["jax.jit (hand-written)"] = (run_jax, lambda: jax.block_until_ready(box["params"]))
    calls["jax.jit (hand-written)"] = args.calls

    model = MLP(args.layers, args.features, ctx=nnx.context(0))
    nnx_step = make_nnx_step()
    variants["nnx.jit + nnx.grad"] = (
        lambda: nnx_step(model, x, y),
        lambda: jax.block_until_ready(model.get_state()),
    )
    calls["nnx.jit + nnx.grad"] = args.calls

    try:
        flax_model, flax_step = make_flax_step(args.layers, args.features)
    except ImportError:
        print("flax is not installed: skipping flax.nnx.jit")
    else:
        from flax import nnx as fnnx

        variants["flax.nnx.jit + flax.nnx.grad"] = (
            lambda: flax_step(flax_model, x, y),
            lambda: jax.block_until_ready(fnnx.state(flax_model)),
        )
        calls["flax.nnx.jit + flax.nnx.grad"] = max(args.calls // 8, 1)

    results = time_interleaved(variants, calls, args.repeats)
    baseline = results["jax.jit (hand-written)"]
    print(
        f"train step, {args.layers} x Linear({args.features}, {args.features}), "
        f"batch {args.batch}, jax {jax.__version__}, {jax.devices()[0].platform}"
    )
    for name, seconds in results.items():
        print(f"  {name:32s} {seconds * 1e6:9.1f} us/call  {seconds / baseline:5.2f}x")


if __name__ == "__main__":
    main()
