"""Decoding speed of `transformer_lm` with a key-value cache, against two baselines run in the same process.

The model has the `shakespeare_char` shape (6 layers, 6 heads, 384 wide,
context 256, the 257-token bytes vocabulary padded to 384) with random
weights. Each way generates the whole context: a 1-token prompt and 256
new tokens per sample, temperature 1.0, at batch 1 and 8:

* ours: `nnx_cli.decoding.Decoder.generate`, streaming tokens to the host
  as they are drawn;
* plain: a decode loop written here in plain JAX on the same weights, with
  the same kind of cache (keys and values `[batch, heads, 256, head_dim]`
  per layer, updated in place, donated), reading the tokens back only at
  the end; target: ours >= 0.9x its tokens/s;
* recompute: no cache, the full forward pass over the sequence so far
  (right-padded to a power of two, as our prefill) for every token; target:
  the cache >= 5x faster. Its time is the sum over buckets of (tokens in
  the bucket) x (the median time of a few steps in it): every step of a
  bucket runs the same compiled program on the same shapes.

Runs alternate (ours, plain, ours, plain, ...) and the best of `--repeats`
is kept, so a busy machine slows both alike. Exit status 1 if a target is
missed.

Run: `python benchmarks/generate.py [--batch-sizes 1 8] [--repeats 3]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import nnx
from nnx_cli.decoding import Decoder
from nnx_cli.models.transformer_lm import MASKED_LOGIT, TransformerLM

SEQ_LEN, VOCAB, LAYERS, HEADS, WIDTH = 256, 257, 6, 6, 384
TEMPERATURE = 1.0
PLAIN_TARGET, RECOMPUTE_TARGET = 0.9, 5.0


def build_model() -> tuple[nnx.State, nnx.ModuleDef]:
    model = TransformerLM((SEQ_LEN,), VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=WIDTH, ctx=nnx.context(0))
    return model.partition(nnx.Param)


# ours
# ------------------------------------------------------------------------------


def run_ours(decoder: Decoder, batch: int) -> float:
    start = time.perf_counter()
    run = decoder.generate([[10]] * batch, max_tokens=SEQ_LEN, temperature=TEMPERATURE, seed=0).finish()
    seconds = time.perf_counter() - start
    assert all(len(s) == SEQ_LEN for s in run.samples), [len(s) for s in run.samples]
    return seconds


# plain JAX, with a cache
# ------------------------------------------------------------------------------


def plain_weights(params: nnx.State) -> dict:
    """Our parameters as plain nested dicts of arrays, one dict per layer."""
    arrays = {path: node.value for path, node in params.items()}

    def layer(i: int) -> dict:
        return {key: value[i] for key, value in arrays.items() if key.startswith("layers/")}

    return {
        "embedding": arrays["embedding/embedding"],
        "positions": arrays["position_embedding/embedding"],
        "final_scale": arrays["final_norm/scale"],
        "final_bias": arrays["final_norm/bias"],
        "layers": [
            {key.removeprefix("layers/scan_module/"): value for key, value in layer(i).items()} for i in range(LAYERS)
        ],
    }


def _layer_norm(x, scale, bias):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def _plain_step(weights, caches, tokens, positions, keys, index):
    x = weights["embedding"][tokens] + weights["positions"][positions]  # [B, E]
    rows, heads, at = jnp.arange(tokens.shape[0])[:, None], jnp.arange(HEADS)[None, :], positions[:, None]
    new_caches = []
    for w, (cached_k, cached_v) in zip(weights["layers"], caches):
        h = _layer_norm(x, w["attention_norm/scale"], w["attention_norm/bias"])
        q, k, v = (
            jnp.einsum("be,ehd->bhd", h, w[f"attention/{n}/kernel"]) + w[f"attention/{n}/bias"]
            for n in ("query", "key", "value")
        )
        cached_k = cached_k.at[rows, heads, at].set(k)
        cached_v = cached_v.at[rows, heads, at].set(v)
        scores = jnp.einsum("bhd,bhtd->bht", q, cached_k) / np.sqrt(q.shape[-1])
        scores = jnp.where(jnp.arange(SEQ_LEN) <= positions[:, None, None], scores, -jnp.inf)
        o = jnp.einsum("bht,bhtd->bhd", jax.nn.softmax(scores, -1), cached_v)
        x = x + jnp.einsum("bhd,hde->be", o, w["attention/out/kernel"]) + w["attention/out/bias"]
        h = _layer_norm(x, w["mlp_norm/scale"], w["mlp_norm/bias"])
        h = jax.nn.gelu(h @ w["mlp/fc/kernel"] + w["mlp/fc/bias"])
        x = x + h @ w["mlp/proj/kernel"] + w["mlp/proj/bias"]
        new_caches.append((cached_k, cached_v))
    logits = _layer_norm(x, weights["final_scale"], weights["final_bias"]) @ weights["embedding"].T
    logits = jnp.where(jnp.arange(logits.shape[-1]) < VOCAB, logits, MASKED_LOGIT)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, index)
    following = jax.vmap(jax.random.categorical)(step_keys, logits / TEMPERATURE)
    return following, new_caches, positions + 1, index + 1


plain_step = jax.jit(_plain_step, donate_argnums=(1,))


def run_plain(weights: dict, batch: int) -> float:
    start = time.perf_counter()
    shape = (batch, HEADS, SEQ_LEN, WIDTH // HEADS)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(LAYERS)]
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(0), jnp.arange(batch, dtype=jnp.uint32))
    tokens, positions, index = jnp.full((batch,), 10, jnp.int32), jnp.zeros((batch,), jnp.int32), jnp.int32(0)
    drawn = []
    for _ in range(SEQ_LEN):
        tokens, caches, positions, index = plain_step(weights, caches, tokens, positions, keys, index)
        drawn.append(tokens)
    np.asarray(jnp.stack(drawn))
    return time.perf_counter() - start


# recompute the whole sequence for every token
# ------------------------------------------------------------------------------


def recompute_seconds(moduledef: nnx.ModuleDef, params: nnx.State, batch: int, steps: int) -> float:
    @jax.jit
    def step(params, tokens, length, key):
        logits = moduledef.apply(params).logits(tokens)[0]
        last = jnp.take_along_axis(logits, (length - 1)[None, None, None], axis=1)[:, 0]
        return jax.random.categorical(key, last / TEMPERATURE).astype(jnp.int32)

    total = 0.0
    width = 16
    while width <= SEQ_LEN:
        tokens = jnp.full((batch, width), 10, jnp.int32)
        lengths = range(width // 2 + 1 if width > 16 else 1, width + 1)  # sequence lengths this bucket serves
        step(params, tokens, jnp.int32(lengths[0]), jax.random.key(0)).block_until_ready()  # compile
        times = []
        for length in list(lengths)[:steps]:
            start = time.perf_counter()
            step(params, tokens, jnp.int32(length), jax.random.key(length)).block_until_ready()
            times.append(time.perf_counter() - start)
        total += len(lengths) * statistics.median(times)
        width *= 2
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recompute-steps", type=int, default=3, help="timed steps per bucket of the recompute way")
    args = parser.parse_args()

    params, moduledef = build_model()
    decoder = Decoder(moduledef, params)
    weights = plain_weights(params)
    print(f"transformer_lm {LAYERS}L/{HEADS}H/{WIDTH}, context {SEQ_LEN}, {jax.devices()[0].platform}")
    print(
        f"{'batch':>5} {'ours tok/s':>11} {'plain tok/s':>12} {'recompute tok/s':>16} {'ours/plain':>11} "
        f"{'cache/recompute':>16}"
    )
    missed = []
    for batch in args.batch_sizes:
        run_ours(decoder, batch), run_plain(weights, batch)  # compile
        ours, plain = [], []
        for _ in range(args.repeats):
            ours.append(run_ours(decoder, batch))
            plain.append(run_plain(weights, batch))
        recompute = recompute_seconds(moduledef, params, batch, args.recompute_steps)
        tokens = batch * SEQ_LEN
        ratio_plain, ratio_recompute = min(plain) / min(ours), recompute / min(ours)
        print(
            f"{batch:>5} {tokens / min(ours):>11.0f} {tokens / min(plain):>12.0f} {tokens / recompute:>16.0f} "
            f"{ratio_plain:>10.2f}x {ratio_recompute:>15.1f}x"
        )
        if ratio_plain < PLAIN_TARGET:
            missed.append(f"batch {batch}: ours is {ratio_plain:.2f}x the plain loop (target {PLAIN_TARGET}x)")
        if ratio_recompute < RECOMPUTE_TARGET:
            missed.append(f"batch {batch}: the cache wins {ratio_recompute:.1f}x (target {RECOMPUTE_TARGET}x)")
    for line in missed:
        print("missed:", line)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
