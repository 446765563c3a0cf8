"""What a training step of a mixture of experts costs against a dense model of the same active parameters.

Both are Llama-style `transformer_lm`s with the same attention; the mixture has `--experts` SwiGLU experts
`--width` wide and routes each token to `--top-k` of them, the dense model one SwiGLU MLP `top_k * width` wide:
per token they compute with the same parameters (the routers aside). One jitted step each (forward,
backward, an SGD update) on the same batches, timed alternately (dense, experts, experts, dense, ...) and
compared by the median: a ratio, which a busy machine disturbs less than absolute times. Beside each, its
step's XLA temporaries (compiled memory analysis: what the backward pass keeps, and the gradients). The mixture
runs with each dispatch this platform can take: `blocks` (each expert's rows in blocks of a `lax.scan`, the CPU
default) and `ragged` (`jax.lax.ragged_dot`, the GPU/TPU default).

With `--quantize nf4` every model's base is stored in 4 bits and the step trains LoRA adapters (rank 16, on
the attention and the MLP or each expert) on it, as QLoRA does (with `--dtype bfloat16`, computing as QLoRA
does). With `--decode` the timed step is a batch-1 decoding step (`TransformerLM.for_decoding`, a cache of
`--seq-len`) instead of a training step. `--dispatch blocks` leaves out `ragged`, which on a CPU computes every
expert on every row.

    python benchmarks/moe_step.py                    # 4 layers, embed 256, 8 experts of 512, top 2
    python benchmarks/moe_step.py --experts 64 --top-k 8 --width 128
    python benchmarks/moe_step.py --vocab 4096          # the blocks' share of the step larger
    python benchmarks/moe_step.py --quantize nf4 --dtype bfloat16 --experts 64 --top-k 8 --width 256 --decode
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp

import nnx
from nnx_cli.models.transformer import TransformerLM


def step_function(model: TransformerLM):
    """A jitted training step (forward, backward, SGD on what trains: the adapters when there are) and its
    arguments' first value."""
    trains = nnx.LoRAParam if model.filter(nnx.LoRAParam) else nnx.Param
    (params, rest), moduledef = model.partition(trains, ...)
    ctx = lambda: nnx.context(dropout=0, flags={"deterministic": False})  # noqa: E731

    @jax.jit
    def step(params, batch):
        def loss(params):
            metrics, _ = moduledef.apply(params, rest).metrics(batch, ctx())
            return jnp.mean(metrics["loss"])

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    return step, params


def decode_function(model: TransformerLM, length: int):
    """A jitted batch-1 decoding step at position 3 of a cache of `length`, and its arguments."""
    decoding = model.for_decoding()
    decoding.init_cache(1, length)
    (cache, rest), cachedef = decoding.partition(nnx.Cache, ...)

    @jax.jit
    def step(cache, rest):
        return cachedef.merge(cache, rest).decode(jnp.asarray([1]), jnp.asarray([3]))

    return step, (cache, rest)


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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype")
    parser.add_argument("--quantize", choices=["nf4", "bfloat16"], help="store the base so and train LoRA on it")
    parser.add_argument("--decode", action="store_true", help="time a batch-1 decoding step, not a training step")
    parser.add_argument("--dispatch", default="blocks,ragged", help="the mixture's dispatches to run (comma-separated)")
    args = parser.parse_args()
    common = dict(num_layers=args.layers, num_heads=args.embed // 64, embed_dim=args.embed, positions="rope",
                  norm="rmsnorm", mlp="swiglu", bias=False, dropout=0.0, dtype=args.dtype)  # fmt: skip
    dense, mixture = dict(common), dict(common)
    if args.quantize:  # QLoRA: adapters on the attention and on the MLP or each expert
        for options, mlp in ((dense, ["gate", "up", "down"]), (mixture, ["experts"])):
            lora = {"rank": 16, "targets": ["q", "k", "v", "o", *mlp]}
            options |= dict(quantize={"type": args.quantize}, lora=lora)
    experts = {"num_experts": args.experts, "top_k": args.top_k, "mlp_dim": args.width}
    models = {"dense": TransformerLM((args.seq_len,), args.vocab, mlp_dim=args.top_k * args.width, **dense,
                                     ctx=nnx.context(0))}  # fmt: skip
    for implementation in args.dispatch.split(","):
        model = TransformerLM((args.seq_len,), args.vocab, moe=experts, **mixture, ctx=nnx.context(0))
        model.layers.scan_module.moe.implementation = implementation
        models[f"experts ({implementation})"] = model
    batch = {"tokens": jax.random.randint(jax.random.key(1), (args.batch, args.seq_len + 1), 0, args.vocab)}
    steps, times, temps = {}, {name: [] for name in models}, {}
    for name, model in models.items():
        step, arguments = decode_function(model, args.seq_len) if args.decode else step_function(model)
        arguments = arguments if args.decode else (arguments, batch)
        start = time.perf_counter()
        temps[name] = step.lower(*arguments).compile().memory_analysis().temp_size_in_bytes / 2**20
        jax.block_until_ready(step(*arguments))
        steps[name] = (step, arguments)
        print(f"{name}: compiled and ran once in {time.perf_counter() - start:.1f} s", flush=True)
    order = list(models)
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:  # alternate, so load drifts reach every side alike
            step, arguments = steps[name]
            start = time.perf_counter()
            jax.block_until_ready(step(*arguments))
            times[name].append(time.perf_counter() - start)
    dense = statistics.median(times["dense"])
    shape = f"{args.layers} layers, embed {args.embed}, vocabulary {args.vocab}, " + (
        f"batch-1 decoding, cache {args.seq_len}" if args.decode else f"batch {args.batch} x {args.seq_len}"
    )
    shape += f", {args.dtype}" + (f", base in {args.quantize}, LoRA r16" if args.quantize else ", full fine-tuning")
    print(f"\n{jax.default_backend()}, {jax.device_count()} device(s), load average {os.getloadavg()[0]:.1f}; {shape}")
    mixture = models[list(models)[1]]
    quantized = [m for _, m in mixture.modules() if isinstance(m, nnx.QuantizedKernel)]  # counted by shape
    total = sum(math.prod(k.shape) for k in quantized) + sum(
        p.value.size for p in mixture.filter(nnx.All(nnx.Param, nnx.Not(nnx.QuantizedParam))).values()
    )
    print(f"parameters a token computes with (outside embeddings): dense {models['dense'].active_params():,}, "
          f"experts {mixture.active_params():,} (of {total:,} in all)")  # fmt: skip
    print("\n| model | step (median) | against dense | XLA temporaries |\n| --- | --- | --- | --- |")
    for name in models:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1e3:.1f} ms | {median / dense:.2f}x | {temps[name]:,.0f} MiB |")


if __name__ == "__main__":
    main()
