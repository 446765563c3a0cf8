"""The language-model baseline: `configs/tiny_lm.yaml`'s byte-level GPT trained by a plain JAX + optax script.

No nnx and no trainer: what a careful JAX user would write, the same recipe
as `nnx-train configs/tiny_lm.yaml` so that the two can be compared on
validation loss and wall time (`benchmarks/lm.py` does):

- data: each document's UTF-8 bytes followed by end-of-document (id 256),
  documents joined in order, tokenized once at start from
  `datasets.load_dataset(source)`; the stream sits on the device and each
  step gathers its windows of `seq_len + 1` tokens there. Epoch `e` lays out
  non-overlapping windows from an offset drawn from
  `np.random.default_rng((seed, e))` and visits them in a permutation drawn
  next from the same generator (nnx-train's scheme: the same batches);
- model: pre-norm blocks (causal attention through
  `jax.nn.dot_product_attention(is_causal=True)`, GELU MLP), learned
  positions, LayerNorm, embeddings tied to the output, vocabulary 257 padded
  to 384 with the padded logits masked; layers stacked and run by one
  `lax.scan`; normal(0.02) init, residual projections scaled by
  `1 / sqrt(2 * layers)`, zero biases;
- parameters drawn by this script, or with `--init PARAMS.npz` the ones
  given (`benchmarks/lm.py` hands it nnx-train's initial parameters, so that
  both sides start from the same point);
- optimizer: clip the global norm at 1.0, then `optax.adamw` with warmup and
  cosine decay, weight decay 0.1 on kernels and embeddings only;
- training: `--steps-per-call` steps per jitted call (one `lax.scan`), JAX's
  persistent compilation cache in `--cache`;
- eval: the first `--eval-batches` batches of the validation split's
  non-overlapping windows from offset 0, mean token cross-entropy in nats.

Prints one JSON line: `{"seconds", "val_loss", "data_seconds", ...}`;
`seconds` runs from the process start, `data_seconds` is the loading and
tokenizing that nnx-train's token cache spares its later runs::

    python benchmarks/plain_lm.py --source ../shared/data/shakespeare --cache /tmp/plain-lm-cache
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import numpy as np

EOD = 256  # end-of-document: after the 256 byte values
VOCAB = 257
PADDED_VOCAB = 384  # the vocabulary rounded up to a multiple of 128
MASKED_LOGIT = -1e30


def tokenize(documents: list[str | None]) -> np.ndarray:
    """Each document's UTF-8 bytes then EOD, joined: uint16 ids.

    >>> tokenize(["hi", "é"]).tolist()
    [104, 105, 256, 195, 169, 256]
    """
    parts = []
    for text in documents:
        if text is not None:
            parts.append(np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16))
            parts.append(np.array([EOD], np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def train_windows(num_tokens: int, seq_len: int) -> int:
    """Windows per epoch: as many as fit when they are laid out from the largest offset, `seq_len`."""
    return (num_tokens - 1 - seq_len) // seq_len


def epoch_starts(num_tokens: int, seq_len: int, seed: int, epoch: int) -> np.ndarray:
    """Start offsets of epoch `epoch`'s windows, in visiting order: an offset in `[0, seq_len]`, then a permutation.

    >>> epoch_starts(100, 8, seed=0, epoch=0).shape
    (11,)
    """
    rng = np.random.default_rng((seed, epoch))
    offset = rng.integers(0, seq_len + 1)
    return offset + rng.permutation(train_windows(num_tokens, seq_len)).astype(np.int64) * seq_len


def batch_starts(num_tokens: int, seq_len: int, seed: int, batch_size: int, first: int, count: int) -> np.ndarray:
    """The window starts of steps `first .. first + count - 1`: int32 `[count, batch_size]`."""
    per_epoch = train_windows(num_tokens, seq_len) // batch_size
    rows, epoch, starts = [], None, None
    for step in range(first, first + count):
        e, i = divmod(step, per_epoch)
        if e != epoch:
            epoch, starts = e, epoch_starts(num_tokens, seq_len, seed, e)
        rows.append(starts[i * batch_size : (i + 1) * batch_size])
    return np.stack(rows).astype(np.int32)


def init_params(key: Any, *, layers: int, heads: int, width: int, seq_len: int) -> dict[str, Any]:
    """The parameters: embeddings, per-layer arrays stacked along a leading `layers` axis, the final norm."""
    import jax
    import jax.numpy as jnp

    head_dim, hidden = width // heads, 4 * width
    residual_std = 0.02 / math.sqrt(2 * layers)
    keys = iter(jax.random.split(key, 8))

    def normal(std: float, *shape: int) -> jax.Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((layers, width)), "bias": jnp.zeros((layers, width))}

    return {
        "embedding": normal(0.02, PADDED_VOCAB, width),
        "position": normal(0.02, seq_len, width),
        "blocks": {
            "attention_norm": norm(),
            "query": {
                "kernel": normal(0.02, layers, width, heads, head_dim),
                "bias": jnp.zeros((layers, heads, head_dim)),
            },
            "key": {
                "kernel": normal(0.02, layers, width, heads, head_dim),
                "bias": jnp.zeros((layers, heads, head_dim)),
            },
            "value": {
                "kernel": normal(0.02, layers, width, heads, head_dim),
                "bias": jnp.zeros((layers, heads, head_dim)),
            },
            "out": {"kernel": normal(residual_std, layers, heads, head_dim, width), "bias": jnp.zeros((layers, width))},
            "mlp_norm": norm(),
            "fc": {"kernel": normal(0.02, layers, width, hidden), "bias": jnp.zeros((layers, hidden))},
            "proj": {"kernel": normal(residual_std, layers, hidden, width), "bias": jnp.zeros((layers, width))},
        },
        "final_norm": {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))},
    }


def from_transformer_lm(params: Any) -> dict[str, Any]:
    """nnx_cli's `TransformerLM` parameters (`(path, value)` pairs, paths like
    `layers/scan_module/attention/query/kernel`) in this script's layout: the same stacked shapes, other names."""
    out: dict[str, Any] = {"blocks": {}}
    for path, value in params:
        parts = path.split("/")
        if parts[0] == "layers":  # layers/scan_module/[attention|mlp/]<layer>/<name>
            out["blocks"].setdefault(parts[-2], {})[parts[-1]] = value
        elif parts[0] == "final_norm":
            out.setdefault("final_norm", {})[parts[1]] = value
        else:
            out[{"embedding": "embedding", "position_embedding": "position"}[parts[0]]] = value
    return out


def load_params(path: str, like: dict[str, Any]) -> dict[str, Any]:
    """The parameters in the .npz at `path`, one array per '/'-joined path of `like` (same shapes)."""
    import jax
    import jax.numpy as jnp

    with np.load(path) as arrays:
        stored = dict(arrays)

    def load(keys: tuple, leaf: Any) -> Any:
        name = "/".join(k.key for k in keys)
        if name not in stored or stored[name].shape != leaf.shape:
            raise SystemExit(f"--init {path}: no {name} of shape {leaf.shape} (has {sorted(stored)})")
        return jnp.asarray(stored[name], leaf.dtype)

    return jax.tree_util.tree_map_with_path(load, like)


def decay_mask(params: dict[str, Any]) -> dict[str, Any]:
    """Weight decay on kernels and embeddings; never on biases or norms (whatever their stacked shape)."""
    import jax

    def decayed(path: tuple, _: Any) -> bool:
        name = path[-1].key
        return name in ("kernel", "embedding", "position")

    return jax.tree_util.tree_map_with_path(decayed, params)


def _layer_norm(x: Any, p: dict[str, Any]) -> Any:
    import jax.numpy as jnp
    from jax import lax

    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.maximum(jnp.mean(jnp.square(x), -1, keepdims=True) - jnp.square(mean), 0.0)
    return (x - mean) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(h: Any, p: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    x = _layer_norm(h, p["attention_norm"])
    q, k, v = (jnp.einsum("bte,ehd->bthd", x, p[n]["kernel"]) + p[n]["bias"] for n in ("query", "key", "value"))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    h = h + jnp.einsum("bthd,hde->bte", o, p["out"]["kernel"]) + p["out"]["bias"]
    x = _layer_norm(h, p["mlp_norm"])
    x = jax.nn.gelu(x @ p["fc"]["kernel"] + p["fc"]["bias"])
    return h + x @ p["proj"]["kernel"] + p["proj"]["bias"]


def logits(params: dict[str, Any], tokens: Any) -> Any:
    """Next-token logits `[B, T, 384]` of int32 `tokens` `[B, T]`; the padded ids masked."""
    import jax.numpy as jnp
    from jax import lax

    h = params["embedding"][tokens] + params["position"][: tokens.shape[1]]
    h, _ = lax.scan(lambda h, p: (_block(h, p), None), h, params["blocks"])
    h = _layer_norm(h, params["final_norm"])
    out = jnp.einsum("bte,ve->btv", h, params["embedding"])
    return jnp.where(jnp.arange(PADDED_VOCAB) < VOCAB, out, MASKED_LOGIT)


def token_losses(params: dict[str, Any], windows: Any) -> Any:
    """Cross-entropy in nats of each next token of `windows` `[B, T + 1]`: `[B, T]`."""
    import jax.numpy as jnp
    import optax

    windows = windows.astype(jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, windows[:, :-1]), windows[:, 1:])


def _since_process_start(fallback: float) -> float:
    """Seconds since this process started (from /proc), or since `fallback` (a perf_counter) elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - fallback


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="../shared/data/shakespeare", help="what datasets.load_dataset reads")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--peak-lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--end-lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--steps-per-call", type=int, default=100, help="training steps in one jitted lax.scan")
    parser.add_argument("--cache", default=None, help="JAX persistent compilation cache directory")
    parser.add_argument(
        "--init", default=None, help="start from these parameters (.npz of '/'-joined paths, as init_params names)"
    )
    args = parser.parse_args()

    import datasets
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import_seconds = _since_process_start(started)
    imported = time.perf_counter()

    splits = datasets.load_dataset(args.source)
    train_tokens, val_tokens = tokenize(splits["train"]["text"]), tokenize(splits["validation"]["text"])
    stream = jax.device_put(train_tokens)
    data_seconds = time.perf_counter() - imported

    seq_len, batch = args.seq_len, args.batch_size
    shape = dict(layers=args.layers, heads=args.heads, width=args.width, seq_len=seq_len)
    params = jax.jit(lambda key: init_params(key, **shape))(jax.random.key(args.seed))  # one program, not op by op
    if args.init:
        params = load_params(args.init, params)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.peak_lr,
        warmup_steps=args.warmup_steps,
        decay_steps=args.steps,
        end_value=args.end_lr,
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1, mask=decay_mask(params)))
    opt_state = jax.jit(tx.init)(params)

    def train_calls(params: Any, opt_state: Any, stream: Any, starts: Any) -> tuple[Any, Any, Any]:
        def step(carry: tuple, starts: Any) -> tuple:
            params, opt_state = carry
            windows = jax.vmap(lambda s: lax.dynamic_slice_in_dim(stream, s, seq_len + 1))(starts)
            loss, grads = jax.value_and_grad(lambda p: jnp.mean(token_losses(p, windows)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = lax.scan(step, (params, opt_state), starts)
        return params, opt_state, losses

    @jax.jit
    def eval_sum(params: Any, windows: Any) -> Any:
        return jnp.sum(token_losses(params, windows))

    k = args.steps_per_call
    if args.steps % k:
        parser.error(f"--steps ({args.steps}) must be a multiple of --steps-per-call ({k})")
    before = time.perf_counter()
    first = batch_starts(len(train_tokens), seq_len, args.seed, batch, 0, k)
    train = jax.jit(train_calls, donate_argnums=(0, 1)).lower(params, opt_state, stream, first).compile()
    compile_seconds = time.perf_counter() - before

    losses = []
    for step in range(0, args.steps, k):
        starts = first if step == 0 else batch_starts(len(train_tokens), seq_len, args.seed, batch, step, k)
        params, opt_state, chunk = train(params, opt_state, stream, starts)
        losses.append(chunk)
    final_train_loss = float(losses[-1][-1])
    train_seconds = time.perf_counter() - before - compile_seconds

    before = time.perf_counter()
    windows = min(args.eval_batches * batch, (len(val_tokens) - 1) // seq_len)
    total = jnp.zeros(())
    for b in range(0, windows, batch):
        rows = np.arange(b, min(b + batch, windows)) * seq_len
        total = total + eval_sum(params, jax.device_put(val_tokens[rows[:, None] + np.arange(seq_len + 1)]))
    val_loss = float(total) / (windows * seq_len)
    eval_seconds = time.perf_counter() - before

    print(
        json.dumps(
            {
                "seconds": round(_since_process_start(started), 3),
                "val_loss": val_loss,
                "import_seconds": round(import_seconds, 3),
                "data_seconds": round(data_seconds, 3),
                "compile_seconds": round(compile_seconds, 3),
                "train_seconds": round(train_seconds, 3),
                "eval_seconds": round(eval_seconds, 3),
                "steps": args.steps,
                "final_train_loss": final_train_loss,
            }
        )
    )


if __name__ == "__main__":
    main()
