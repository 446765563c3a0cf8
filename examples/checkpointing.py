"""Saving and loading a model with Orbax.

A Module's ``State`` is a pytree, so Orbax saves it as it is. To load, nnx
needs no real model: ``jax.eval_shape`` runs the constructor abstractly and
gives the ``State`` of shapes and dtypes plus the ``ModuleDef``; Orbax
restores the arrays into that structure and ``merge`` builds the Module.
No memory is spent on throw-away initial parameters.

    python examples/checkpointing.py --steps 200 --directory /tmp/nnx-ckpt
"""

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import nnx


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, ctx: nnx.Context):
        self.linear1 = nnx.Linear(din, dhidden, ctx=ctx)
        self.bn = nnx.BatchNorm(dhidden, ctx=ctx)
        self.linear2 = nnx.Linear(dhidden, dout, ctx=ctx)

    def __call__(self, x, *, train: bool):
        x = nnx.relu(self.bn(self.linear1(x), use_running_average=not train))
        return self.linear2(x)


def train(model: MLP, steps: int) -> float:
    """A few steps of regression to ``sum(x)`` so the saved state is not the init."""
    tx = optax.adam(1e-2)
    opt_state = tx.init(model.filter(nnx.Param))

    @nnx.jit
    def train_step(model: MLP, opt_state, x):

        def loss_fn(model: MLP):
            y = jnp.sum(x, axis=-1, keepdims=True)
            loss = jnp.mean((model(x, train=True) - y) ** 2)
            return loss, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        params = model.filter(nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        model.update_state(optax.apply_updates(params, updates))
        return loss, opt_state

    rng = np.random.default_rng(0)
    loss = float("nan")
    for _ in range(steps):
        x = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
        loss, opt_state = train_step(model, opt_state, x)
    return float(loss)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--directory", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.directory or tempfile.mkdtemp(prefix="nnx-ckpt-"))
    path = os.path.join(directory, "model")

    def create() -> MLP:
        return MLP(4, args.hidden, 1, ctx=nnx.context(0))

    model = create()
    loss = train(model, args.steps)
    print(f"trained for {args.steps} steps, loss {loss:.4f}")

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, model.get_state(), force=True)
    checkpointer.wait_until_finished()
    print(f"saved to {path}")

    # Restore: shapes and structure from eval_shape, values from the checkpoint.
    abstract_state, moduledef = jax.eval_shape(lambda: create().partition())
    print("abstract kernel:", abstract_state["linear1/kernel"].value)
    state = checkpointer.restore(path, abstract_state)
    restored = moduledef.merge(state)

    x = jnp.ones((2, 4))
    same = bool(jnp.allclose(model(x, train=False), restored(x, train=False)))
    print(f"restored model gives the same outputs: {same}")
    return {"loss": loss, "same_outputs": same, "path": path, "paths": sorted(state)}


if __name__ == "__main__":
    main()
