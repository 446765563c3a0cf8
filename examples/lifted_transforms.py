"""Lifted transforms: nnx.jit and nnx.grad take the Module itself.

A digit classifier (scikit-learn's 8x8 digits) with BatchNorm and Dropout,
trained with a step that receives the model, mutates it (new parameters,
updated batch statistics) and lets ``nnx.jit`` write every change back. The
RNG Context for dropout is passed as ``ctx=`` and forked at each call.
Evaluation uses ``stateful=False``: it cannot change the model.

    python examples/lifted_transforms.py --steps 300
"""

import argparse
import functools

import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import nnx


class Classifier(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, ctx: nnx.Context):
        self.linear1 = nnx.Linear(din, dhidden, ctx=ctx)
        self.bn = nnx.BatchNorm(dhidden, ctx=ctx)
        self.dropout = nnx.Dropout(0.2)
        self.linear2 = nnx.Linear(dhidden, dout, ctx=ctx)

    def __call__(self, x, *, train: bool, ctx: nnx.Context = None):
        x = self.linear1(x)
        x = self.bn(x, use_running_average=not train)
        x = self.dropout(nnx.relu(x), deterministic=not train, ctx=ctx)
        return self.linear2(x)


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = len(x) * 4 // 5
    return (x[:split], y[:split]), (x[split:], y[split:])


def batches(x, y, batch_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    while True:
        index = rng.integers(0, len(x), size=batch_size)
        yield jnp.asarray(x[index]), jnp.asarray(y[index])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_data()
    model = Classifier(64, args.hidden, 10, ctx=nnx.context(0))
    tx = optax.adam(1e-3)
    opt_state = tx.init(model.filter(nnx.Param))

    @nnx.jit
    def train_step(model: Classifier, opt_state, x, y, *, ctx: nnx.Context):

        def loss_fn(model: Classifier, ctx: nnx.Context):
            logits = model(x, train=True, ctx=ctx)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, loss  # (value to differentiate, aux)

        # grads: a State of Params keyed like the model ('linear1/kernel', ...).
        # The BatchNorm statistics updated inside loss_fn are written back. The
        # Context goes in as an argument: one captured from outside would belong
        # to another trace level.
        grads, loss = nnx.grad(loss_fn, has_aux=True)(model, ctx=ctx)
        params = model.filter(nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        model.update_state(optax.apply_updates(params, updates))
        return loss, opt_state

    @functools.partial(nnx.jit, stateful=False)
    def accuracy(model: Classifier, x, y):
        return jnp.mean(jnp.argmax(model(x, train=False), axis=-1) == y)

    ctx = nnx.context(dropout=1)
    data = batches(x_train, y_train, args.batch_size)
    losses = []
    for step in range(args.steps):
        x, y = next(data)
        loss, opt_state = train_step(model, opt_state, x, y, ctx=ctx)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")

    test_accuracy = float(accuracy(model, jnp.asarray(x_test), jnp.asarray(y_test)))
    print(f"test accuracy {test_accuracy:.3f}")
    return {"losses": losses, "accuracy": test_accuracy}


if __name__ == "__main__":
    main()
