"""`vae`: a variational autoencoder for images."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

import nnx
from nnx_cli.models.layers import check_sizes, hidden_axes, linear, mlp

Batch = dict[str, jax.Array]


class VAE(nnx.Module):
    """A variational autoencoder with MLP encoder/decoder and a Bernoulli decoder.

    Metrics, in nats per example: `recon` (Bernoulli negative log-likelihood),
    `kl` (KL(q(z|x) || N(0, I))) and `nelbo = recon + kl`, the single-sample
    negative ELBO that training minimises.

    Args:
        input_shape: one image's shape (flattened into the encoder).
        num_classes: unused (a VAE needs no labels).
        hidden_sizes: the encoder's hidden widths (the decoder mirrors them).
        latent_size: the latent dimension.
        ctx: the `params` RNG stream.
    """

    loss_metric = "nelbo"

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int | None = None,
        *,
        hidden_sizes: Sequence[int] = (512,),
        latent_size: int = 32,
        ctx: nnx.Context,
    ):
        self.input_shape = tuple(input_shape)
        self.latent_size = latent_size
        pixels = math.prod(input_shape)
        hidden = check_sizes("hidden_sizes", hidden_sizes)
        check_sizes("latent_size", [latent_size], one=True)
        sizes, axes = [pixels, *hidden], ["embed", *hidden_axes(len(hidden))]
        self.encoder = mlp(sizes, axes, ctx)
        self.mean = linear(sizes[-1], latent_size, (axes[-1], "latent"), ctx)
        self.logvar = linear(sizes[-1], latent_size, (axes[-1], "latent"), ctx)
        self.decoder = mlp(
            [latent_size, *reversed(hidden), pixels], ["latent", *hidden_axes(len(hidden)), "embed"], ctx
        )

    def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = x.reshape(x.shape[0], -1)
        for layer in self.encoder:
            h = jax.nn.relu(layer(h))
        return self.mean(h), self.logvar(h)

    def decode(self, z: jax.Array) -> jax.Array:
        """Bernoulli logits, shaped like the input."""
        *hidden, out = list(self.decoder)
        h = z
        for layer in hidden:
            h = jax.nn.relu(layer(h))
        return out(h).reshape(z.shape[0], *self.input_shape)

    def metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        x = batch["image"]
        mean, logvar = self.encode(x)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(ctx.make_rng("sample"), mean.shape)
        logits = self.decode(z)
        recon = optax.sigmoid_binary_cross_entropy(logits, x).reshape(x.shape[0], -1).sum(-1)
        kl = 0.5 * jnp.sum(jnp.exp(logvar) + mean**2 - 1.0 - logvar, axis=-1)
        return {"nelbo": recon + kl, "recon": recon, "kl": kl}

    def images(self, batch: Batch, ctx: nnx.Context) -> jax.Array:
        """Rows: 8 inputs, their reconstructions (posterior mean), 16 samples from the prior."""
        x = batch["image"][:8]
        mean, _ = self.encode(x)
        recon = jax.nn.sigmoid(self.decode(mean))
        samples = jax.nn.sigmoid(self.decode(jax.random.normal(ctx.make_rng("sample"), (16, self.latent_size))))
        return jnp.concatenate([x, recon, samples])
