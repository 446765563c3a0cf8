"""The time-to-result baseline: `configs/digits_vae.yaml`'s model trained by a plain JAX + optax script.

What a careful JAX user would write for speed: the whole training split on
the device, one `lax.scan` per epoch (one dispatch for 23 steps), JAX's
persistent compilation cache on. Same data (scikit-learn's bundled digits,
read from its CSV, first 1500 train, binarized at 0.5), model (MLP 64-128-8
encoder and 8-128-64 Bernoulli decoder, relu, lecun-normal kernels, zero
biases), objective (single-sample negative ELBO), optimizer (Adam 3e-3),
batch 64, 40 epochs. Prints one JSON line: `{"seconds", "test_nelbo"}`.

    python benchmarks/plain_digits_vae.py --cache /tmp/jax-cache
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache", default=None, help="JAX persistent compilation cache directory")
    args = parser.parse_args()
    start = time.perf_counter()

    import importlib.util
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    csv = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0]) / "datasets/data/digits.csv.gz"
    table = np.loadtxt(csv, delimiter=",")
    pixels = (table[:, :-1] / 16.0 > 0.5).astype(np.float32)
    train, test = jax.device_put(pixels[:1500]), jax.device_put(pixels[1500:])

    def dense(key, din, dout):
        return {"w": jax.nn.initializers.lecun_normal()(key, (din, dout)), "b": jnp.zeros((dout,))}

    keys = jax.random.split(jax.random.key(args.seed), 5)
    params = {
        "enc": dense(keys[0], 64, 128),
        "mean": dense(keys[1], 128, 8),
        "logvar": dense(keys[2], 128, 8),
        "dec": dense(keys[3], 8, 128),
        "out": dense(keys[4], 128, 64),
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

    tx = optax.adam(3e-3)
    steps_per_epoch = len(train) // args.batch_size

    @jax.jit
    def epoch(params, opt_state, perm, first_step):
        def step(carry, i):
            params, opt_state = carry
            x = train[jax.lax.dynamic_slice_in_dim(perm, i * args.batch_size, args.batch_size)]
            key = jax.random.fold_in(jax.random.key(args.seed), first_step + i)
            loss, grads = jax.value_and_grad(lambda p: jnp.mean(nelbo(p, x, key)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), jnp.arange(steps_per_epoch))
        return params, opt_state, losses

    params, opt_state = jax.jit(lambda p: (p, tx.init(p)))(params)
    for e in range(args.epochs):
        perm = np.random.default_rng((args.seed, e)).permutation(len(train)).astype(np.int32)
        params, opt_state, _ = epoch(params, opt_state, perm, e * steps_per_epoch)
    test_nelbo = float(jax.jit(lambda p, x: jnp.mean(nelbo(p, x, jax.random.key(args.seed + 1))))(params, test))
    print(json.dumps({"seconds": round(time.perf_counter() - start, 3), "test_nelbo": round(test_nelbo, 3)}))


if __name__ == "__main__":
    main()
