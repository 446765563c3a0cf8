"""A small decoder-only Transformer: scan over layers and a kv-cache.

The task: continue arithmetic sequences modulo ``vocab`` (``a, a+b, a+2b,
...``); the model has to read the step ``b`` from the prompt. The layers
are one ``nnx.Scan`` (parameters stacked, one compiled block for any
depth). For decoding, every layer gets a key/value cache (``nnx.Cache``
variables, also stacked by the scan) so each new token costs one position
of attention instead of a full forward pass.

    python examples/transformer.py --steps 600
"""

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnx


def attend(q, k, v, mask):
    """Softmax attention; q ``(b, tq, h, d)``, k/v ``(b, tk, h, d)``, mask ``(tq, tk)``."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(*out.shape[:2], -1)


class Attention(nnx.Module):
    def __init__(self, features: int, heads: int, *, ctx: nnx.Context):
        self.heads = heads
        self.qkv = nnx.Linear(features, 3 * features, ctx=ctx)
        self.out = nnx.Linear(features, features, ctx=ctx)

    def _qkv(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        return [t.reshape(*t.shape[:2], self.heads, -1) for t in (q, k, v)]

    def __call__(self, x):
        """Causal self-attention over a whole sequence ``x (batch, length, features)``."""
        q, k, v = self._qkv(x)
        length = x.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))
        return self.out(attend(q, k, v, causal))

    def init_cache(self, batch: int, max_length: int, head_dim: int):
        shape = (batch, max_length, self.heads, head_dim)
        self.cache_k = nnx.Cache(jnp.zeros(shape))
        self.cache_v = nnx.Cache(jnp.zeros(shape))
        self.cache_index = nnx.Cache(jnp.asarray(0, jnp.int32))

    def decode(self, x):
        """Attention for one new position ``x (batch, 1, features)`` using the cache."""
        q, k, v = self._qkv(x)
        index = self.cache_index
        self.cache_k = jax.lax.dynamic_update_slice(self.cache_k, k, (0, index, 0, 0))
        self.cache_v = jax.lax.dynamic_update_slice(self.cache_v, v, (0, index, 0, 0))
        self.cache_index = index + 1
        visible = (jnp.arange(self.cache_k.shape[1]) <= index)[None, :]
        return self.out(attend(q, self.cache_k, self.cache_v, visible))


class Block(nnx.Module):
    """Pre-norm Transformer block; methods have the scan signature (carry, x)."""

    def __init__(self, features: int, heads: int, hidden: int, *, ctx: nnx.Context):
        self.norm1 = nnx.LayerNorm(features, ctx=ctx)
        self.attention = Attention(features, heads, ctx=ctx)
        self.norm2 = nnx.LayerNorm(features, ctx=ctx)
        self.mlp_in = nnx.Linear(features, hidden, ctx=ctx)
        self.mlp_out = nnx.Linear(hidden, features, ctx=ctx)

    def _mlp(self, x):
        return self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))

    def __call__(self, x, _):
        x = x + self.attention(self.norm1(x))
        return x + self._mlp(x), None

    def init_cache(self, x, _, batch: int, max_length: int, head_dim: int):
        self.attention.init_cache(batch, max_length, head_dim)
        return x, None

    def decode(self, x, _):
        x = x + self.attention.decode(self.norm1(x))
        return x + self._mlp(x), None


class Transformer(nnx.Module):
    def __init__(self, vocab: int, max_length: int, features: int, heads: int, depth: int, *, ctx: nnx.Context):
        self.max_length = max_length
        self.head_dim = features // heads
        self.tokens = nnx.Embed(vocab, features, ctx=ctx)
        self.positions = nnx.Embed(max_length, features, ctx=ctx)
        self.layers = nnx.Scan(
            Block,
            variable_axes={nnx.Param: 0, nnx.Cache: 0},  # one slice per layer
            split_rngs="params",
            length=depth,
        )(features, heads, 4 * features, ctx=ctx)
        self.norm = nnx.LayerNorm(features, ctx=ctx)

    def __call__(self, tokens):
        """Next-token logits for every position of ``tokens (batch, length)``."""
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        x, _ = self.layers(x, None)
        return self.tokens.attend(self.norm(x))

    def init_cache(self, batch: int):
        """Creates empty caches in every layer (stacked by the scan)."""
        self.layers.call.init_cache(None, None, batch, self.max_length, self.head_dim)

    def decode(self, token, position):
        """Next-token logits after ``token (batch, 1)`` at ``position``; fills the cache."""
        x = self.tokens(token) + self.positions(position)[None, None]
        x, _ = self.layers.call.decode(x, None)
        return self.tokens.attend(self.norm(x))[:, 0]


def sequences(batch: int, length: int, vocab: int, rng):
    start = rng.integers(0, vocab, size=(batch, 1))
    step = rng.integers(1, vocab, size=(batch, 1))
    return jnp.asarray((start + step * np.arange(length)) % vocab, jnp.int32)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=13)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=3)
    args = parser.parse_args(argv)

    model = Transformer(args.vocab, args.length, args.features, args.heads, args.depth, ctx=nnx.context(0))
    tx = optax.adam(3e-3)
    opt_state = tx.init(model.filter(nnx.Param))

    @nnx.jit
    def train_step(model: Transformer, opt_state, tokens):

        def loss_fn(model: Transformer):
            logits = model(tokens[:, :-1])
            targets = tokens[:, 1:]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
            return loss, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        params = model.filter(nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        model.update_state(optax.apply_updates(params, updates))
        return loss, opt_state

    rng = np.random.default_rng(0)
    losses = []
    for step in range(args.steps):
        batch = sequences(args.batch_size, args.length, args.vocab, rng)
        loss, opt_state = train_step(model, opt_state, batch)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")

    # Greedy decoding with the kv-cache: feed the prompt, then the model's own
    # predictions, one token per call.
    init_cache = nnx.jit(Transformer.init_cache, static_argnums=1)
    decode = nnx.jit(Transformer.decode)
    test = sequences(8, args.length, args.vocab, rng)
    init_cache(model, test.shape[0])
    token, generated, step_logits = test[:, :1], [], []
    for position in range(args.length - 1):
        logits = decode(model, token, jnp.asarray(position))
        step_logits.append(logits)
        prediction = jnp.argmax(logits, axis=-1)[:, None]
        token = test[:, position + 1 : position + 2] if position + 1 < args.prompt else prediction
        generated.append(prediction[:, 0])
    generated = jnp.stack(generated, axis=1)

    # The cache must give the same logits as a full forward pass on the same tokens.
    fed = jnp.concatenate([test[:, : args.prompt], generated[:, args.prompt - 1 : -1]], axis=1)
    full = nnx.jit(Transformer.__call__, stateful=False)(model, fed)
    max_difference = float(jnp.max(jnp.abs(full - jnp.stack(step_logits, axis=1))))
    accuracy = float(jnp.mean(generated[:, args.prompt - 1 :] == test[:, args.prompt :]))
    print(
        f"prompt {np.asarray(test[0, : args.prompt])} -> "
        f"{np.asarray(generated[0, args.prompt - 1 :])} "
        f"(expected {np.asarray(test[0, args.prompt :])})"
    )
    print(f"continuation accuracy {accuracy:.3f}; cached vs full logits differ by at most {max_difference:.1e}")
    return {"losses": losses, "accuracy": accuracy, "max_difference": max_difference}


if __name__ == "__main__":
    main()
