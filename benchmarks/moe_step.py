"""What a training step of a mixture of experts costs against a dense model of the same active parameters.

Both are Llama-style `transformer_lm`s with the same attention; the mixture has `--experts` SwiGLU experts
`--width` wide and routes each token to `--top-k` of them, the dense model one SwiGLU MLP `top_k * width` wide:
per token they compute with the same parameters (the routers aside). One jitted step each (forward,
backward, an SGD update) on the same batches, timed alternately (dense, experts, experts, dense, ...) and
compared by the median: a ratio, which a busy machine disturbs less than absolute times. Beside each, its
step's XLA temporaries (compiled memory analysis: what the backward pass keeps, and the gradients). The mixture
runs with each dispatch this platform can take: `blocks` (each expert's rows in blocks of a `lax.scan`, the CPU
default) and `ragged` (`jax.lax.ragged_dot`, the GPU/TPU default).

    python benchmarks/moe_step.py                    # 4 layers, embed 256, 8 experts of 512, top 2
    python benchmarks/moe_step.py --experts 64 --top-k 8 --width 128
    python benchmarks/moe_step.py --vocab 4096          # the blocks' share of the step larger
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

import nnx
from nnx_cli.models.transformer import TransformerLM


def step_function(model: TransformerLM):
    (params, rest), moduledef = model.partition(nnx.Param, ...)
    ctx = lambda: nnx.context(dropout=0, flags={"deterministic": False})  # noqa: E731

    @jax.jit
    def step(params, batch):
        def loss(params):
            metrics, _ = moduledef.apply(params, rest).metrics(batch, ctx())
            return jnp.mean(metrics["loss"])

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    return step, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--width", type=int, default=512, help="each expert's hidden width")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    common = dict(num_layers=args.layers, num_heads=args.embed // 64, embed_dim=args.embed, positions="rope",
                  norm="rmsnorm", mlp="swiglu", bias=False, dropout=0.0)  # fmt: skip
    experts = {"num_experts": args.experts, "top_k": args.top_k, "mlp_dim": args.width}
    models = {"dense": TransformerLM((args.seq_len,), args.vocab, mlp_dim=args.top_k * args.width, **common,
                                     ctx=nnx.context(0))}  # fmt: skip
    for implementation in ("blocks", "ragged"):
        model = TransformerLM((args.seq_len,), args.vocab, moe=experts, **common, ctx=nnx.context(0))
        model.layers.scan_module.moe.implementation = implementation
        models[f"experts ({implementation})"] = model
    batch = {"tokens": jax.random.randint(jax.random.key(1), (args.batch, args.seq_len + 1), 0, args.vocab)}
    steps, times, temps = {}, {name: [] for name in models}, {}
    for name, model in models.items():
        step, params = step_function(model)
        start = time.perf_counter()
        temps[name] = step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes / 2**20
        jax.block_until_ready(step(params, batch))
        steps[name] = (step, params)
        print(f"{name}: compiled and ran once in {time.perf_counter() - start:.1f} s", flush=True)
    order = list(models)
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:  # alternate, so load drifts reach every side alike
            step, params = steps[name]
            start = time.perf_counter()
            jax.block_until_ready(step(params, batch))
            times[name].append(time.perf_counter() - start)
    dense = statistics.median(times["dense"])
    shape = f"{args.layers} layers, embed {args.embed}, vocabulary {args.vocab}, batch {args.batch} x {args.seq_len}"
    print(f"\n{jax.default_backend()}, {jax.device_count()} device(s), load average {os.getloadavg()[0]:.1f}; {shape}")
    mixture = models["experts (blocks)"]
    total = sum(p.value.size for p in mixture.filter(nnx.Param).values())
    print(f"parameters a token computes with (outside embeddings): dense {models['dense'].active_params():,}, "
          f"experts {mixture.active_params():,} (of {total:,} in all)")  # fmt: skip
    print("\n| model | step (median) | against dense | XLA temporaries |\n| --- | --- | --- | --- |")
    for name in models:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1e3:.0f} ms | {median / dense:.2f}x | {temps[name]:,.0f} MiB |")


if __name__ == "__main__":
    main()
