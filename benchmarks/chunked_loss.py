"""The head and cross-entropy split (`models/transformer/loss.py`): chunks of positions, blocks of the vocabulary,
against the whole logits.

On `benchmarks/profile_step.py`'s Qwen2.5-0.5B shape (24 layers, 896 wide, vocabulary 151,936, tied head),
sequence 512, batch 2, AdamW, LoRA rank 16 on all seven projections, computing in bfloat16, the trainer's own
`steps.train_step` is compiled three ways: with the logits computed whole (`loss.CHUNK_BYTES` raised past them:
plain autodiff, the computation the model made before splitting), in chunks of positions (what a GPU or a mesh
sharding the vocabulary takes) and in blocks of the vocabulary (what a CPU takes). Prints:

1. XLA's memory analysis of each compiled step (MiB of temporaries, the step's own peak beside the state it
   reads), for LoRA on a float32 base (`lora32`, no `model.quantize`), on a bfloat16 base (`lora`,
   `model.quantize: {type: bfloat16}`) and QLoRA (`qlora`, `{type: nf4}`), each with `model.remat` none and
   full. Nothing runs: the state is abstract. Target: both splits' temporaries at least 1 GB below the whole
   one's in every row (the float32 logits and their gradient, 2 x 593 MiB).
2. The step's time on this machine, chunks of positions (A) against vocabulary blocks (B), run A B B A,
   `--steps` steps each after one unmeasured, on one variant (`--time`, default QLoRA, remat none, computing in
   `--dtype`, default bfloat16): the median of each run, the B/A ratio, and how far the two runs of each side
   differ (the machine's noise). Blocks are the default on a CPU (`loss.blocks_apply`); a 16-bit head is sliced
   as its bits, and both parts give the step its frozen base as the trainer does, as bits
   (`steps.frozen_as_bits`). Speed means nothing on a busy machine: run it idle; the load average is printed
   before and after.

    python benchmarks/chunked_loss.py [--part 1|2] [--time qlora|lora|lora32] [--dtype float32|bfloat16] [--steps 3]
                                      [--tiny]

`--tiny` (2 layers, sequence 128) smoke-tests the script; the vocabulary stays Qwen's, so the logits are still
split (156 MB of them: three chunks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profile_step import build

from nnx_cli import steps
from nnx_cli.models.transformer import loss

VARIANTS = {"lora32": None, "lora": {"type": "bfloat16"}, "qlora": {"type": "nf4"}}  # model.quantize of each
WHOLE = 1 << 62  # loss.CHUNK_BYTES past any logits: one chunk
MIB = 2**20


def compile_step(variant: str, remat: str, chunk_bytes: int, batch: int, seq_len: int | None, layers: int | None,
                 blocks: bool = False, dtype: str = "bfloat16"):  # fmt: skip
    """The train step of `variant` compiled with `loss.CHUNK_BYTES` at `chunk_bytes` (donating its state), the
    logits split in vocabulary `blocks` or chunks of positions, and what builds its state: the model's builder,
    the optimizer, the model's options."""
    builder, options = build("qwen05", True, seq_len, layers, {"dtype": dtype, "remat": remat,
                                                               "quantize": VARIANTS[variant]})  # fmt: skip
    tx = optax.adamw(1e-4, weight_decay=0.0)
    moduledef, abstract = jax.eval_shape(lambda: steps.init_state(builder, tx, 0))
    abstract[steps.FROZEN] = jax.eval_shape(steps.frozen_as_bits, abstract[steps.FROZEN])  # as the trainer holds it
    sums = jax.eval_shape(lambda: steps.empty_sums(["loss", "accuracy"]))
    tokens = jax.ShapeDtypeStruct((batch, options["seq_len"] + 1), jnp.int32)

    def step(state, sums, batch):
        return steps.train_step(moduledef, tx, "loss", 0, state, sums, batch)

    kept = loss.CHUNK_BYTES, loss.blocks_apply
    loss.CHUNK_BYTES, loss.blocks_apply = chunk_bytes, lambda *shape: blocks
    try:
        compiled = jax.jit(step, donate_argnums=(0,)).lower(abstract, sums, {"tokens": tokens}).compile()
    finally:
        loss.CHUNK_BYTES, loss.blocks_apply = kept
    return compiled, (builder, tx, options)


def part1(batch: int, seq_len: int | None, layers: int | None) -> None:
    print("XLA's memory analysis of the train step (MiB): temporaries, whole logits -> split (arguments)\n")
    print("| variant | remat | whole | position chunks | vocabulary blocks | saved (least) | arguments |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        for remat in ("none", "full"):
            whole, chunked, blocked = (compile_step(variant, remat, b, batch, seq_len, layers, k)[0].memory_analysis()
                                       for b, k in ((WHOLE, False), (loss.chunk_bytes(), False),
                                                    (loss.chunk_bytes(), True)))  # fmt: skip
            before, chunks, blocks = (x.temp_size_in_bytes / MIB for x in (whole, chunked, blocked))
            after = max(chunks, blocks)
            print(f"| {variant} | {remat} | {before:.0f} | {chunks:.0f} | {blocks:.0f} | {before - after:.0f} "
                  f"({1 - after / before:.0%}) | {chunked.argument_size_in_bytes / MIB:.0f} |", flush=True)  # fmt: skip


def part2(variant: str, batch: int, seq_len: int | None, layers: int | None, n: int, dtype: str) -> None:
    chunked, (builder, tx, options) = compile_step(variant, "none", loss.chunk_bytes(), batch, seq_len, layers,
                                                   dtype=dtype)  # fmt: skip
    blocked, _ = compile_step(variant, "none", loss.chunk_bytes(), batch, seq_len, layers, blocks=True, dtype=dtype)
    _, state = jax.jit(lambda: steps.init_state(builder, tx, 0))()
    state[steps.FROZEN] = steps.frozen_as_bits(state[steps.FROZEN])
    sums = steps.empty_sums(["loss", "accuracy"])
    tokens = np.random.default_rng(0).integers(0, options["vocab_size"], (batch, options["seq_len"] + 1))
    data = {"tokens": jnp.asarray(tokens, jnp.int32)}
    print(f"\n{variant}, computing in {dtype}, remat none, batch {batch}, sequence {options['seq_len']}: seconds "
          f"per step, A B B A "
          f"(A: chunks of positions, B: vocabulary blocks), {n} steps each after one unmeasured; load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    runs: dict[str, list[float]] = {"A": [], "B": []}
    for name in "ABBA":
        step = chunked if name == "A" else blocked
        seconds = []
        for i in range(n + 1):
            start = time.perf_counter()
            state, sums, value = step(state, sums, data)
            value.block_until_ready()
            if i:
                seconds.append(time.perf_counter() - start)
        runs[name].append(statistics.median(seconds))
        print(f"  {name}: median {runs[name][-1]:.2f} s  (each: {' '.join(f'{s:.2f}' for s in seconds)})", flush=True)
    a, b = statistics.mean(runs["A"]), statistics.mean(runs["B"])
    noise = max(abs(x - y) / min(x, y) for x, y in (runs["A"], runs["B"]))
    print(f"chunks {a:.2f} s, blocks {b:.2f} s per step: blocks take {b / a:.3f}x the time; the two runs of a "
          f"side differ by up to {noise:.1%}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", type=int, choices=(1, 2), default=None, help="run one part only")
    parser.add_argument("--time", choices=sorted(VARIANTS), default="qlora", help="part 2's variant")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run of part 2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="part 2's model.dtype")
    parser.add_argument("--tiny", action="store_true", help="2 layers, sequence 128: a smoke test of the script")
    args = parser.parse_args()
    seq_len, layers = (128, 2) if args.tiny else (None, None)
    if args.part in (None, 1):
        part1(args.batch, seq_len, layers)
    if args.part in (None, 2):
        part2(args.time, args.batch, seq_len, layers, args.steps, args.dtype)


if __name__ == "__main__":
    main()
