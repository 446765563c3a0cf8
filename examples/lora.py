"""Low-rank adapters: fine-tune a frozen model by training `nnx.LoRA` alone.

A small MLP is first trained on `y = sin(x)`; then its weights are frozen and a
rank-4 LoRA adapter on its hidden layer learns `y = sin(x) + 0.5 cos(2x)`. One
`partition(nnx.LoRAParam, nnx.Param)` separates what trains (the adapters,
`nnx.LoRAParam`) from what stays (the base weights, `nnx.Param`): gradients
and optimizer state exist for the adapters only, and the base weights come out
bit for bit as they went in. Merging adds each adapter's `delta()` to its
kernel: one dense layer again, with the same outputs.

    python examples/lora.py --steps 500
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnx


class MLP(nnx.Module):
    def __init__(self, hidden: int, rank: int | None, *, ctx: nnx.Context):
        self.linear1 = nnx.Linear(1, hidden, ctx=ctx)
        self.linear2 = nnx.Linear(hidden, hidden, ctx=ctx)
        self.linear3 = nnx.Linear(hidden, 1, ctx=ctx)
        self.lora = nnx.LoRA(hidden, hidden, rank=rank, alpha=2 * rank, ctx=ctx) if rank else None  # on linear2

    def __call__(self, x):
        h = nnx.tanh(self.linear1(x))
        h = nnx.tanh(self.linear2(h) + (self.lora(h) if self.lora is not None else 0.0))
        return self.linear3(h)


def fit(moduledef, trained, fixed, target, steps: int, learning_rate: float, seed: int) -> tuple:
    """Adam on the `trained` state alone; `fixed` goes in unchanged."""
    tx = optax.adam(learning_rate)
    opt_state = tx.init(trained)
    rng = np.random.default_rng(seed)

    @jax.jit
    def step(trained, opt_state, x):
        def loss_fn(trained):
            y, _ = moduledef.apply(trained, *fixed)(x)
            return jnp.mean((y - target(x)) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(trained)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(trained, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        x = jnp.asarray(rng.uniform(-3, 3, (64, 1)), jnp.float32)
        trained, opt_state, loss = step(trained, opt_state, x)
        losses.append(float(loss))
    return trained, opt_state, losses


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args(argv)

    # 1. The base model learns sin(x).
    base = MLP(args.hidden, None, ctx=nnx.context(0))
    params, basedef = base.partition(nnx.Param)
    params, _, _ = fit(basedef, params, (), jnp.sin, args.steps, 1e-2, seed=0)

    # 2. Adapters learn the new target on top of the frozen weights.
    model = MLP(args.hidden, args.rank, ctx=nnx.context(1))
    model.update_state(params)  # the trained base weights, under the adapters
    (adapters, frozen), moduledef = model.partition(nnx.LoRAParam, nnx.Param)
    new_target = lambda x: jnp.sin(x) + 0.5 * jnp.cos(2 * x)  # noqa: E731
    before = float(jnp.mean((moduledef.apply(adapters, frozen)(jnp.linspace(-3, 3, 256)[:, None])[0]
                             - new_target(jnp.linspace(-3, 3, 256)[:, None])) ** 2))  # fmt: skip
    adapters, opt_state, losses = fit(moduledef, adapters, (frozen,), new_target, args.steps, 1e-2, seed=1)

    # 3. Merge: each kernel plus its adapter's update is one plain dense layer again.
    tuned = moduledef.merge(adapters, frozen)
    merged = MLP(args.hidden, None, ctx=nnx.context(2))
    merged.update_state(tuned.filter(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    merged.linear2.kernel = tuned.linear2.kernel + tuned.lora.delta()
    x = jnp.linspace(-3, 3, 256)[:, None]
    leaves = jax.tree.leaves
    return {
        "loss_before": before,
        "losses": losses,
        "trainable": sum(a.size for a in jax.tree.leaves(adapters)),
        "frozen": sum(a.size for a in jax.tree.leaves(frozen)),
        "optimizer_leaves": len(jax.tree.leaves(opt_state)),
        "base_unchanged": all(bool(jnp.array_equal(a, b)) for a, b in zip(leaves(frozen), leaves(params))),
        "merge_error": float(jnp.max(jnp.abs(merged(x) - tuned(x)))),
    }


if __name__ == "__main__":
    out = main()
    print(
        f"adapters: {out['trainable']} parameters trained, {out['frozen']} frozen (unchanged: {out['base_unchanged']})"
    )
    print(f"loss on the new target: {out['loss_before']:.4f} before, {np.mean(out['losses'][-20:]):.4f} after")
    print(f"merged into plain dense layers: largest difference {out['merge_error']:.2e}")
