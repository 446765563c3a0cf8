"""Parameter surgery with filters: reuse a backbone, freeze it, train a head.

1. Pretrain a classifier on digits 0-4.
2. Build a new model for digits 5-9, copy the pretrained backbone into it
   (states are keyed by path, so ``update_state`` with the backbone's
   entries is the whole transplant) and give it a fresh head.
3. Fine-tune only the head: the filter ``nnx.All(nnx.Param, not backbone)``
   selects what ``nnx.grad`` differentiates and what the optimizer sees.
4. Check that the backbone did not move, and inspect/replace a layer.

    python examples/surgery.py --steps 200
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import nnx


class Backbone(nnx.Module):
    def __init__(self, features: int, *, ctx: nnx.Context):
        self.linear1 = nnx.Linear(64, features, ctx=ctx)
        self.linear2 = nnx.Linear(features, features, ctx=ctx)

    def __call__(self, x):
        return nnx.relu(self.linear2(nnx.relu(self.linear1(x))))


class Classifier(nnx.Module):
    def __init__(self, features: int, classes: int, *, ctx: nnx.Context):
        self.backbone = Backbone(features, ctx=ctx)
        self.head = nnx.Linear(features, classes, ctx=ctx)

    def __call__(self, x):
        return self.head(self.backbone(x))


def in_backbone(path: str, _) -> bool:
    return path.startswith("backbone/")


TRAINABLE_HEAD = nnx.All(nnx.Param, nnx.Not(in_backbone))


def fit(model: Classifier, x, y, steps: int, wrt=nnx.Param) -> float:
    """Adam on the parameters selected by ``wrt``; returns the last loss."""
    tx = optax.adam(3e-3)
    opt_state = tx.init(model.filter(wrt))

    @nnx.jit
    def train_step(model: Classifier, opt_state, x, y):

        def loss_fn(model: Classifier):
            logits = model(x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, loss

        grads, loss = nnx.grad(loss_fn, wrt=wrt, has_aux=True)(model)
        params = model.filter(wrt)  # same entries as grads
        updates, opt_state = tx.update(grads, opt_state, params)
        model.update_state(optax.apply_updates(params, updates))
        return loss, opt_state

    rng = np.random.default_rng(0)
    loss = float("nan")
    for _ in range(steps):
        index = rng.integers(0, len(x), size=64)
        loss, opt_state = train_step(model, opt_state, x[index], y[index])
    return float(loss)


def accuracy(model: Classifier, x, y) -> float:
    return float(jnp.mean(jnp.argmax(model(x), axis=-1) == y))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--features", type=int, default=64)
    args = parser.parse_args(argv)

    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    low, high = digits.target < 5, digits.target >= 5
    x_low, y_low = images[low], digits.target[low].astype(np.int32)
    x_high, y_high = images[high], (digits.target[high] - 5).astype(np.int32)

    # 1. pretrain on 0-4
    pretrained = Classifier(args.features, 5, ctx=nnx.context(0))
    loss = fit(pretrained, x_low, y_low, args.steps)
    print(f"pretrained on 0-4: loss {loss:.3f}, accuracy {accuracy(pretrained, x_low, y_low):.3f}")

    # 2. transplant the backbone into a new model with a fresh head
    model = Classifier(args.features, 5, ctx=nnx.context(1))
    backbone_state = pretrained.filter(in_backbone)
    model.update_state(backbone_state)
    print("copied:", ", ".join(backbone_state))

    # 3. fine-tune only the head on 5-9
    before = model.filter(in_backbone)
    loss = fit(model, x_high, y_high, args.steps, wrt=TRAINABLE_HEAD)
    fine_tuned = accuracy(model, x_high, y_high)
    print(f"head fine-tuned on 5-9: loss {loss:.3f}, accuracy {fine_tuned:.3f}")

    # 4. the backbone is untouched; layers can be inspected and replaced
    after = model.filter(in_backbone)
    frozen = all(bool(jnp.array_equal(before[path].value, after[path].value)) for path in before)
    print(f"backbone unchanged by fine-tuning: {frozen}")
    trainable = model.filter(TRAINABLE_HEAD)
    n_trainable = sum(x.size for x in jax.tree.leaves(trainable))
    n_total = sum(x.size for x in jax.tree.leaves(model.filter(nnx.Param)))
    print(f"trainable parameters: {n_trainable} of {n_total}")
    model.head = nnx.Linear(args.features, 10, ctx=nnx.context(2))  # a wider head
    print("new head kernel:", model.head.kernel.shape)
    return {
        "frozen": frozen,
        "trainable": sorted(trainable),
        "accuracy": fine_tuned,
        "head_shape": model.head.kernel.shape,
    }


if __name__ == "__main__":
    main()
