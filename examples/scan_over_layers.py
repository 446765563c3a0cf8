"""Scan over layers: one compiled block, stacked parameters, split RNGs.

A deep residual MLP classifies scikit-learn's 8x8 digits. Its ``depth``
blocks are built by ``nnx.Scan``: every block's parameters are stacked along
a leading axis (``variable_axes={nnx.Param: 0}``) and the forward pass is a
``jax.lax.scan``, so compile time does not grow with depth. The ``params``
and ``dropout`` streams are split so that each block gets its own
initialisation and dropout mask. The BatchNorm statistics are not stacked:
they are *carried* from block to block (``variable_carry``, the default for
everything not stacked), so all blocks share one set of running statistics.

    python examples/scan_over_layers.py --steps 300 --depth 8
"""

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import nnx


class Block(nnx.Module):
    """``x + dropout(relu(batchnorm(linear(layernorm(x)))))``."""

    def __init__(self, features: int, *, ctx: nnx.Context):
        self.norm = nnx.LayerNorm(features, ctx=ctx)
        self.linear = nnx.Linear(features, features, ctx=ctx)
        self.bn = nnx.BatchNorm(features, ctx=ctx)
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x, _, *, ctx: nnx.Context):
        # (carry, x) -> (carry, y): the scan's signature; nothing to slice here.
        h = self.bn(self.linear(self.norm(x)), ctx=ctx)  # mode from the ctx flags
        return x + self.dropout(nnx.relu(h), ctx=ctx), None


class DeepMLP(nnx.Module):
    def __init__(self, features: int, depth: int, *, ctx: nnx.Context):
        self.embed = nnx.Linear(64, features, ctx=ctx)
        ScanBlocks = nnx.Scan(
            Block,
            variable_axes={nnx.Param: 0},
            split_rngs=("params", "dropout"),
            length=depth,
        )
        self.blocks = ScanBlocks(features, ctx=ctx)
        self.head = nnx.Linear(features, 10, ctx=ctx)

    def __call__(self, x, *, ctx: nnx.Context):
        x, _ = self.blocks(self.embed(x), None, ctx=ctx)
        return self.head(x)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    digits = load_digits()
    x_all = (digits.data / 16.0).astype(np.float32)
    y_all = digits.target.astype(np.int32)

    model = DeepMLP(args.features, args.depth, ctx=nnx.context(0))
    kernel = model.blocks.scan_module.linear.kernel
    print(f"{args.depth} blocks, stacked kernel shape {kernel.shape}")
    tx = optax.adam(1e-3)
    opt_state = tx.init(model.filter(nnx.Param))

    @nnx.jit
    def train_step(model: DeepMLP, opt_state, x, y, *, ctx: nnx.Context):

        def loss_fn(model: DeepMLP, ctx: nnx.Context):
            logits = model(x, ctx=ctx)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model, ctx=ctx)
        params = model.filter(nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        model.update_state(optax.apply_updates(params, updates))
        return loss, opt_state

    train_flags = {"deterministic": False, "use_running_average": False}
    ctx = nnx.context(dropout=1, flags=train_flags)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(args.steps):
        index = rng.integers(0, len(x_all), size=args.batch_size)
        loss, opt_state = train_step(model, opt_state, x_all[index], y_all[index], ctx=ctx)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")

    # stateful=False: evaluating never changes the model (not even BatchNorm).
    evaluate = nnx.jit(lambda m, x, *, ctx: m(x, ctx=ctx), stateful=False)

    def accuracy(use_running_average: bool) -> float:
        flags = {"deterministic": True, "use_running_average": use_running_average}
        logits = evaluate(model, x_all, ctx=nnx.context(flags=flags))
        return float(jnp.mean(jnp.argmax(logits, -1) == y_all))

    # One set of running statistics serves every block, so it is a compromise
    # between the blocks' own statistics: compare with per-batch statistics.
    running, batch = accuracy(True), accuracy(False)
    print(f"training-set accuracy: {running:.3f} with the shared running statistics, {batch:.3f} with batch statistics")
    return {
        "losses": losses,
        "accuracy": running,
        "batch_accuracy": batch,
        "kernel_shape": kernel.shape,
        "batch_stats_shape": model.blocks.scan_module.bn.mean.shape,
    }


if __name__ == "__main__":
    main()
