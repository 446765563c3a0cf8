"""The training attention, forward and backward, against JAX's own on the same device.

Times `attention_core` (causal, blocked queries, no weights saved for the backward pass) against
`jax.nn.dot_product_attention` with XLA's implementation (which saves the weights) and, on a GPU, cuDNN's
fused kernel, the path `transformer_lm` takes there. Each timing is the fastest of `--repeats` calls after
a warm-up, of the output alone and of the gradients of `sum(o * cotangent)` with respect to q, k and v. Also
prints the largest difference of each one's output and gradients from XLA's, so a fast wrong kernel shows.

Shapes: the held-out fine-tuning shape (Qwen2-like: 8 query heads on 2 key-value heads, length 1,024,
batch 2), SmolLM2-135M's (9 on 3, length 256, batch 4) and, on a GPU, a GPT-2-small-sized one (12 heads,
length 1,024, batch 16). Float32 on CPU, bfloat16 on a GPU (`--dtype` overrides).

    python benchmarks/attention.py [--shapes heldout,smollm2,gpt] [--dtype float32|bfloat16] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nnx_cli.models.transformer.attention_core import attention_core

SHAPES = {  # batch, length, query heads, key-value heads, head dim
    "heldout": (2, 1024, 8, 2, 64),
    "smollm2": (4, 256, 9, 3, 64),
    "gpt": (16, 1024, 12, 12, 64),
}


def fastest(fn, args, repeats: int) -> float:
    """Milliseconds of the fastest of `repeats` calls, after two warm-up calls (the first compiles)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def implementations(gpu: bool) -> dict:
    def jax_attention(implementation):
        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

        return attend

    out = {"xla (jax.nn)": jax_attention("xla"), "attention_core": lambda q, k, v: attention_core(q, k, v)}
    if gpu:
        out["cudnn (jax.nn)"] = jax_attention("cudnn")
    return out


def run_shape(name: str, dtype, repeats: int, gpu: bool) -> None:
    b, t, h, kv, d = SHAPES[name]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k = jax.random.normal(keys[1], (b, t, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, t, kv, d), dtype)
    cotangent = jax.random.normal(keys[3], (b, t, h, d), dtype)
    # causal: about half of the two products of the forward pass; the backward pass does twice that
    flops = 4 * b * h * t * t * d / 2
    print(f"\n{name}: batch {b}, length {t}, heads {h} on {kv}, head dim {d}, {jnp.dtype(dtype).name}")
    print("| attention | forward ms | forward+backward ms | fwd+bwd GFLOP/s | vs xla | max diff (o, dq) |")
    print("| --- | --- | --- | --- | --- | --- |")
    reference, base = None, None
    for label, attend in implementations(gpu).items():
        forward = jax.jit(attend)
        grads = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v) * cotangent), argnums=(0, 1, 2)))  # noqa: B023
        try:
            o = forward(q, k, v)
            _, (dq, _, _) = grads(q, k, v)
            f_ms, fb_ms = fastest(forward, (q, k, v), repeats), fastest(grads, (q, k, v), repeats)
        except Exception as error:  # cuDNN refuses some shapes and dtypes: say so and go on
            print(f"| {label} | - | - | - | - | {type(error).__name__}: {str(error).splitlines()[0][:80]} |")
            continue
        if reference is None:
            reference, base = (o.astype(jnp.float32), dq.astype(jnp.float32)), fb_ms
        diff = (
            float(jnp.max(jnp.abs(o.astype(jnp.float32) - reference[0]))),
            float(jnp.max(jnp.abs(dq.astype(jnp.float32) - reference[1]))),
        )
        print(
            f"| {label} | {f_ms:.2f} | {fb_ms:.2f} | {3 * flops / fb_ms / 1e6:.0f} | {base / fb_ms:.2f}x "
            f"| {diff[0]:.1e}, {diff[1]:.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help=f"of {', '.join(SHAPES)} (default: all on a GPU, else "
                        "heldout,smollm2)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"
    shapes = (args.shapes or (",".join(SHAPES) if gpu else "heldout,smollm2")).split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shape {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    print(f"device: {jax.devices()[0].device_kind}, {jax.device_count()} device(s), jax {jax.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name in shapes:
        run_shape(name, dtype, args.repeats, gpu)


if __name__ == "__main__":
    main()
