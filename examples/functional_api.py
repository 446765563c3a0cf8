"""The functional API: partition a Module, train with plain jax.jit/jax.grad.

A Module is split into pure ``State``s (here the parameters and a call
counter) and a static ``ModuleDef``. The train step is an ordinary jitted
function of arrays: ``moduledef.apply`` rebuilds the model inside it and
returns the output together with the updated state. At the end ``merge``
turns the trained state back into a Module.

    python examples/functional_api.py --steps 500
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import nnx


class Count(nnx.Variable):
    """A custom kind of state: filters can select it by type."""


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, ctx: nnx.Context):
        self.count = Count(jnp.asarray(0))
        self.linear1 = nnx.Linear(din, dhidden, ctx=ctx)
        self.linear2 = nnx.Linear(dhidden, dout, ctx=ctx)

    def __call__(self, x):
        self.count += 1
        return self.linear2(nnx.relu(self.linear1(x)))


def dataset(batch_size: int, seed: int = 0):
    """Endless batches of ``y = sin(x) + noise`` on ``[-3, 3]``."""
    rng = np.random.default_rng(seed)
    while True:
        x = rng.uniform(-3, 3, size=(batch_size, 1))
        y = np.sin(x) + 0.1 * rng.normal(size=x.shape)
        yield jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    args = parser.parse_args(argv)

    model = MLP(1, args.hidden, 1, ctx=nnx.context(0))
    (params, counts), moduledef = model.partition(nnx.Param, Count)

    @jax.jit
    def train_step(params, counts, x, y):

        def loss_fn(params):
            y_pred, (updates, _) = moduledef.apply(params, counts)(x)
            return jnp.mean((y_pred - y) ** 2), updates.filter(Count)

        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params = jax.tree.map(lambda w, g: w - args.learning_rate * g, params, grads)
        return loss, params, counts

    losses = []
    batches = dataset(args.batch_size)
    for step in range(args.steps):
        x, y = next(batches)
        loss, params, counts = train_step(params, counts, x, y)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")

    model = moduledef.merge(params, counts)
    print(f"the model was called {int(model.count)} times")
    return {"losses": losses, "count": int(model.count)}


if __name__ == "__main__":
    main()
