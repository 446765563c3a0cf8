"""The baseline: the MNIST VAE in plain JAX + optax, no nnx, no trainer.

Same data (`datasets`, decoded once, binarized at 0.5), same model (MLP
784-512-32 encoder, 32-512-784 Bernoulli decoder, relu, lecun-normal
kernels, zero biases), same objective (single-sample negative ELBO), same
optimizer (Adam 1e-3), batch 128, one permutation per epoch, last partial
batch dropped; with `--on-device` the training split sits on the device and each epoch is one `lax.scan`
(the fastest plain form, the baseline on a GPU). Prints one JSON line: `{"seconds", "test_nelbo", ...}`.

    python benchmarks/plain_vae.py --source ../shared/data/mnist --epochs 30
"""

from __future__ import annotations

import argparse
import io
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="ylecun/mnist")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--on-device", action="store_true", help="the data on the device, one lax.scan per epoch")
    args = parser.parse_args()
    start = time.perf_counter()

    import datasets
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from PIL import Image

    def load(split: str) -> np.ndarray:
        ds = datasets.load_dataset(args.source, split=split).cast_column("image", datasets.Image(decode=False))
        pixels = np.stack([np.asarray(Image.open(io.BytesIO(item["bytes"]))) for item in ds["image"]])
        return (pixels.reshape(len(pixels), -1) / 255.0 > 0.5).astype(np.float32)

    train, test = load("train"), load("test")

    def dense(key, din, dout):
        return {"w": jax.nn.initializers.lecun_normal()(key, (din, dout)), "b": jnp.zeros((dout,))}

    keys = jax.random.split(jax.random.key(args.seed), 5)
    params = {
        "enc": dense(keys[0], 784, 512),
        "mean": dense(keys[1], 512, 32),
        "logvar": dense(keys[2], 512, 32),
        "dec": dense(keys[3], 32, 512),
        "out": dense(keys[4], 512, 784),
    }

    def nelbo(params, x, key):
        h = jax.nn.relu(x @ params["enc"]["w"] + params["enc"]["b"])
        mean = h @ params["mean"]["w"] + params["mean"]["b"]
        logvar = h @ params["logvar"]["w"] + params["logvar"]["b"]
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        h = jax.nn.relu(z @ params["dec"]["w"] + params["dec"]["b"])
        logits = h @ params["out"]["w"] + params["out"]["b"]
        recon = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
        kl = 0.5 * jnp.sum(jnp.exp(logvar) + mean**2 - 1.0 - logvar, -1)
        return recon + kl

    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, step):
        key = jax.random.fold_in(jax.random.key(args.seed), step)
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(nelbo(p, x, key)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_sum(params, x, key):
        return jnp.sum(nelbo(params, x, key))

    steps_per_epoch = len(train) // args.batch_size
    step = 0
    if args.on_device:  # the fastest plain form: no host feed, one dispatch per epoch
        resident = jax.device_put(train)

        @jax.jit
        def epoch_steps(params, opt_state, perm, first):
            def one(carry, i):
                params, opt_state, _ = carry
                x = resident[jax.lax.dynamic_slice_in_dim(perm, i * args.batch_size, args.batch_size)]
                return train_step(params, opt_state, x, first + i), None

            carry = (params, opt_state, jnp.zeros(()))
            return jax.lax.scan(one, carry, jnp.arange(steps_per_epoch))[0]

        for epoch in range(args.epochs):
            perm = jnp.asarray(np.random.default_rng((args.seed, epoch)).permutation(len(train)))
            params, opt_state, loss = epoch_steps(params, opt_state, perm, step)
            step += steps_per_epoch
    for epoch in range(0 if args.on_device else args.epochs):
        perm = np.random.default_rng((args.seed, epoch)).permutation(len(train))
        for i in range(steps_per_epoch):
            x = jax.device_put(train[perm[i * args.batch_size : (i + 1) * args.batch_size]])
            params, opt_state, loss = train_step(params, opt_state, x, step)
            step += 1
    eval_key = jax.random.key(args.seed + 1)
    total = sum(
        float(eval_sum(params, jax.device_put(test[i : i + 1000]), jax.random.fold_in(eval_key, i)))
        for i in range(0, len(test), 1000)
    )
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {"seconds": seconds, "test_nelbo": total / len(test), "steps": step, "final_train_loss": float(loss)}
        )
    )


if __name__ == "__main__":
    main()
