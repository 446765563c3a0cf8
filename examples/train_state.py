"""TrainState: parameters, optimizer state and step as one pytree.

The model is partitioned once into ``params`` and ``batch_stats``; an
``nnx.TrainState`` holds them with the optax state, and the whole training
state goes through ``jax.jit`` as an ordinary pytree. ``state.apply`` runs
the model functionally and returns the updated batch statistics, which
``apply_gradients`` stores together with the new parameters.

    python examples/train_state.py --steps 300
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import nnx


class CNN(nnx.Module):
    """A small convolutional classifier for 8x8 digit images."""

    def __init__(self, *, features: int, ctx: nnx.Context):
        self.conv = nnx.Conv(1, features, (3, 3), ctx=ctx)
        self.bn = nnx.BatchNorm(features, ctx=ctx)
        self.head = nnx.Linear(features * 16, 10, ctx=ctx)

    def __call__(self, images, *, train: bool):
        x = self.conv(images)
        x = nnx.relu(self.bn(x, use_running_average=not train))
        x = x.reshape(x.shape[0], 4, 2, 4, 2, -1).mean(axis=(2, 4))  # 2x2 pooling
        return self.head(x.reshape(x.shape[0], -1))


def load_data(seed: int = 0):
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(images))
    split = len(images) * 4 // 5
    train, test = order[:split], order[split:]
    return (images[train], labels[train]), (images[test], labels[test])


@jax.jit
def train_step(state: nnx.TrainState, images, labels):

    def loss_fn(params):
        logits, updates = state.apply(params, "batch_stats")(images, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads, batch_stats=updates.filter(nnx.BatchStat))
    return state, loss


@jax.jit
def accuracy(state: nnx.TrainState, images, labels):
    logits, _ = state.apply("params", "batch_stats")(images, train=False)
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=16)
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_data()
    model = CNN(features=args.features, ctx=nnx.context(0))
    (params, batch_stats), moduledef = model.partition(nnx.Param, nnx.BatchStat)
    state = nnx.TrainState(moduledef, params=params, tx=optax.adam(3e-3), batch_stats=batch_stats)

    rng = np.random.default_rng(0)
    losses = []
    for step in range(args.steps):
        index = rng.integers(0, len(x_train), size=args.batch_size)
        state, loss = train_step(state, x_train[index], y_train[index])
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {int(state.step):4d}  loss {loss:.4f}")

    test_accuracy = float(accuracy(state, x_test, y_test))
    print(f"test accuracy {test_accuracy:.3f}")
    # Back to a Module whenever one is handy:
    model = state.moduledef.merge(state.params, state.batch_stats)
    return {"losses": losses, "accuracy": test_accuracy, "step": int(state.step)}


if __name__ == "__main__":
    main()
