"""A variational autoencoder on scikit-learn's 8x8 digits.

The encoder maps an image to the mean and log-variance of a Gaussian over a
small latent space; a sample (reparameterised with a key from the ``noise``
stream of the Context) is decoded back to pixel logits. The loss is the
negative ELBO: reconstruction cross-entropy plus the KL divergence to the
standard normal prior. Trained with ``nnx.jit`` + ``nnx.grad`` + optax.

    python examples/vae.py --steps 1000
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import nnx


class Encoder(nnx.Module):
    def __init__(self, din: int, dhidden: int, dlatent: int, *, ctx: nnx.Context):
        self.hidden = nnx.Linear(din, dhidden, ctx=ctx)
        self.mean = nnx.Linear(dhidden, dlatent, ctx=ctx)
        self.logvar = nnx.Linear(dhidden, dlatent, ctx=ctx)

    def __call__(self, x):
        h = nnx.relu(self.hidden(x))
        return self.mean(h), self.logvar(h)


class Decoder(nnx.Module):
    def __init__(self, dlatent: int, dhidden: int, dout: int, *, ctx: nnx.Context):
        self.hidden = nnx.Linear(dlatent, dhidden, ctx=ctx)
        self.out = nnx.Linear(dhidden, dout, ctx=ctx)

    def __call__(self, z):
        return self.out(nnx.relu(self.hidden(z)))  # pixel logits


class VAE(nnx.Module):
    def __init__(self, din: int, dhidden: int, dlatent: int, *, ctx: nnx.Context):
        self.encoder = Encoder(din, dhidden, dlatent, ctx=ctx)
        self.decoder = Decoder(dlatent, dhidden, din, ctx=ctx)

    def __call__(self, x, *, ctx: nnx.Context):
        mean, logvar = self.encoder(x)
        eps = jax.random.normal(ctx.make_rng("noise"), mean.shape)
        z = mean + jnp.exp(0.5 * logvar) * eps
        return self.decoder(z), mean, logvar

    def generate(self, z):
        return nnx.sigmoid(self.decoder(z))


def negative_elbo(model: VAE, x, ctx: nnx.Context):
    logits, mean, logvar = model(x, ctx=ctx)
    reconstruction = optax.sigmoid_binary_cross_entropy(logits, x).sum(axis=-1)
    kl = 0.5 * jnp.sum(jnp.exp(logvar) + mean**2 - 1.0 - logvar, axis=-1)
    return jnp.mean(reconstruction + kl)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--latent", type=int, default=4)
    args = parser.parse_args(argv)

    images = (load_digits().data / 16.0).astype(np.float32)  # in [0, 1]
    model = VAE(64, args.hidden, args.latent, ctx=nnx.context(0))
    tx = optax.adam(1e-3)
    opt_state = tx.init(model.filter(nnx.Param))

    @nnx.jit
    def train_step(model: VAE, opt_state, x, *, ctx: nnx.Context):

        def loss_fn(model: VAE, ctx: nnx.Context):
            loss = negative_elbo(model, x, ctx)
            return loss, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model, ctx=ctx)
        params = model.filter(nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        model.update_state(optax.apply_updates(params, updates))
        return loss, opt_state

    ctx = nnx.context(noise=1)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(args.steps):
        x = images[rng.integers(0, len(images), size=args.batch_size)]
        loss, opt_state = train_step(model, opt_state, jnp.asarray(x), ctx=ctx)
        losses.append(float(loss))
        if step % 200 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  negative ELBO {loss:.2f}")

    samples = nnx.jit(VAE.generate, stateful=False)(model, jax.random.normal(jax.random.key(0), (4, args.latent)))
    for row in np.asarray(samples[0]).reshape(8, 8):
        print("".join(" .:-=+*#"[min(int(p * 8), 7)] for p in row))
    return {"losses": losses, "samples": np.asarray(samples)}


if __name__ == "__main__":
    main()
