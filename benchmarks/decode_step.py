"""One batch-1 decoding step on a frozen 16-bit or 4-bit base, in the layout the decoder takes and in the other.

A Qwen2.5-0.5B-shaped `transformer_lm` (24 layers, 896 wide, 4,864 MLP, 14 heads of 64, 2 key-value heads,
151,936 ids, a tied table), random weights, LoRA r16 on all seven projections, computing in bfloat16, on the
CPU. For each base, one decoding step compiled as the decoder runs it (`TransformerLM.for_decoding`): its
median time over alternating halves (A B B A, 15 steps a half) and XLA's temporaries:

- `bf16 base`: `model.quantize: {type: bfloat16}`, decoded on per-layer weights (unrolled);
- `nf4 stacked`: `model.quantize: {type: nf4}`, decoded on its stacked layers, as the decoder does;
- `nf4 unrolled`: the same model unrolled, as the decoder took it before (the baseline): XLA dequantises every
  layer's kernels ahead of their products, a bfloat16 copy of the base in each step.

`--sampling` also times GRPO's sampling loop (`objectives.rollouts.sample_completions`, one compiled program:
8 prompts of 64 tokens, 16 new tokens each) on the nf4 base, stacked and unrolled: unrolled, XLA dequantises
once before the loop (faster, a 16-bit copy of the base for the whole loop); stacked, in every step.

    python benchmarks/decode_step.py [--sampling] [--layers 24]

Speed means nothing on a busy machine: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import nnx
from nnx_cli.models.transformer.model import TransformerLM
from nnx_cli.objectives.rollouts import sample_completions

LORA = {"rank": 16, "alpha": 32, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
SHAPE = dict(num_heads=14, num_kv_heads=2, head_dim=64, embed_dim=896, mlp_dim=4864, mlp="swiglu", positions="rope",
             norm="rmsnorm", bias=False, qkv_bias=True, dtype="bfloat16", vocab_size=151936, dropout=0.0,
             max_positions=512, lora=LORA)  # fmt: skip


def model(layers: int, kind: str) -> TransformerLM:
    return TransformerLM((512,), num_layers=layers, quantize={"type": kind}, ctx=nnx.context(0), **SHAPE)


def decode_step(decoding: TransformerLM) -> tuple:
    """The batch-1 decoding step of `decoding` (laid out as given), compiled, and its arguments."""
    decoding.init_cache(1, 512)
    (cache, rest), cachedef = decoding.partition(nnx.Cache, ...)
    step = jax.jit(lambda cache, rest: cachedef.merge(cache, rest).decode(jnp.asarray([1]), jnp.asarray([3])))
    return step.lower(cache, rest).compile(), (cache, rest)


def sampler(decoding: TransformerLM, tokens: jax.Array, lengths: jax.Array) -> tuple:
    """GRPO's sampling loop on `decoding`'s weights (it lays them out with `for_decoding` itself), compiled."""
    states, moduledef = decoding.partition(nnx.Param, ...)

    def sample(states: tuple, tokens: jax.Array, lengths: jax.Array, key: jax.Array) -> dict:
        return sample_completions(moduledef, states, tokens, lengths, key, max_new_tokens=16, temperature=1.0,
                                  stop_ids=(151935,))  # fmt: skip

    key = jax.random.key(0)
    return jax.jit(sample).lower(states, tokens, lengths, key).compile(), (states, tokens, lengths, key)


def alternate(ways: dict[str, tuple], runs: int) -> dict[str, list[float]]:
    """Seconds of each compiled way's calls, in two halves, A B B A."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for order in (list(ways), list(ways)[::-1]):
        for name in order:
            compiled, args = ways[name]
            jax.block_until_ready(compiled(*args))
            for _ in range(runs):
                start = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                times[name].append(time.perf_counter() - start)
    return times


def table(ways: dict[str, tuple], times: dict[str, list[float]], unit: str, scale: float) -> None:
    print(f"\n| {unit} | median | fastest | temporaries MiB (XLA) |")
    print("| --- | --- | --- | --- |")
    for name, (compiled, _) in ways.items():
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"| {name} | {statistics.median(times[name]) * scale:,.1f} | {min(times[name]) * scale:,.1f} | "
              f"{temp:,.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=15, help="timed steps a half")
    parser.add_argument("--sampling", action="store_true", help="also GRPO's sampling loop on the nf4 base")
    args = parser.parse_args()
    print(f"load average (1 min) at the start: {os.getloadavg()[0]:.2f}; {jax.devices()[0].platform}")
    nf4 = model(args.layers, "nf4")
    ways = {"nf4 stacked (the decoder's)": decode_step(nf4.for_decoding()),
            "nf4 unrolled (before)": decode_step(nf4.unstack_layers().in_compute_dtype())}  # fmt: skip
    ways["bf16 base (unrolled)"] = decode_step(model(args.layers, "bfloat16").for_decoding())
    table(ways, alternate(ways, args.steps), "batch-1 decoding step, ms", 1000)
    if args.sampling:
        rng = np.random.default_rng(0)
        tokens, lengths = jnp.asarray(rng.integers(0, 1000, (8, 64)), jnp.int32), jnp.full((8,), 64, jnp.int32)
        loops = {"nf4 stacked (now)": sampler(nf4, tokens, lengths),
                 "nf4 unrolled (before)": sampler(nf4.unstack_layers(), tokens, lengths)}  # fmt: skip
        table(loops, alternate(loops, 2), "GRPO sampling, 8 x (64 + 16) tokens, s", 1)
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
