"""Where the time of one training step goes: the per-part split of a step, read from the XLA trace.

Builds `transformer_lm` on a shape (by default SmolLM2-135M's: 30 layers, 576 wide, 9 query heads sharing 3
key-value heads, SwiGLU 1536, vocabulary 49152, tied head; `--shape gpt2` is GPT-2 small, the GPU's MFU figure's
model, to profile on a GPU with `--dtype bfloat16 --batch 16`), random weights, and jits the trainer's own
`steps.train_step` with AdamW, LoRA (rank 16, alpha 32, all seven projections) or fully. Runs a few steps,
then traces `--trace-steps` more with `jax.profiler` and sums each executed XLA operation's time into a part:

- matmuls: dot products (and fusions around one) of the projections and the MLP, forward and backward;
- attention: the attention core (scores, softmax, weighted values, their gradients), wherever its ops land;
- head: the output projection (tied or not), the cross-entropy and the training accuracy;
- transposes/copies: operations that only move data (transpose, copy, concatenate, pad, slices);
- scan residuals: what the layer scan saves for the backward: stacking into `[layers, ...]` buffers, their
  zero fill and the per-layer slices read back;
- optimizer: the AdamW update and the gradient norm;
- other: elementwise work (norms, rotary, activations, residual adds).

An operation belongs to attention, head or optimizer when the source line it was traced from lies in the
functions named below (see `PARTS`), or to attention when its name carries the model's `attention` scope (see
`SCOPES`: on a CPU the layer's operations keep no deeper frame); to the others by what it computes. Prints the
table and the ten most expensive operations, so the next person can see where time goes without reading HLO::

    python benchmarks/profile_step.py [--lora] [--shape smollm2|heldout] [--seq-len 256] [--batch 4]

The held-out shape (`--shape heldout`) is grouped-query attention with biases on the query, key and value
projections (Qwen2's layout), 8 query heads on 2 key-value heads, sequence 512 by default: the fixes must hold
beyond the shape they were measured on.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    "smollm2": dict(  # SmolLM2-135M
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, embed_dim=576, mlp_dim=1536, vocab_size=49152,
        qkv_bias=False, rope_theta=100000.0, seq_len=256,
    ),
    "heldout": dict(  # Qwen2-like: grouped-query attention with query/key/value biases, longer rows
        num_layers=12, num_heads=8, num_kv_heads=2, head_dim=64, embed_dim=512, mlp_dim=1408, vocab_size=32000,
        qkv_bias=True, rope_theta=1000000.0, seq_len=512,
    ),
    "qwen05": dict(  # Qwen2.5-0.5B: benchmarks/qlora.py's shape
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, embed_dim=896, mlp_dim=4864, vocab_size=151936,
        qkv_bias=True, rope_theta=1000000.0, seq_len=512,
    ),
    "gpt2": dict(  # GPT-2 small as benchmarks/gpt.py trains it on a GPU: LayerNorm, GELU, learned positions, biases
        num_layers=12, num_heads=12, embed_dim=768, mlp_dim=3072, vocab_size=50304, mlp="gelu", bias=True,
        qkv_bias=True, norm="layernorm", positions="learned", seq_len=1024,
    ),
    "shakespeare": dict(  # configs/shakespeare_char.yaml's byte-level GPT (train with --batch 64 --dropout 0.2)
        num_layers=6, num_heads=6, embed_dim=384, mlp_dim=1536, vocab_size=384, mlp="gelu", bias=True,
        qkv_bias=True, norm="layernorm", positions="learned", seq_len=256,
    ),
    "moe": dict(  # fine-grained experts (Qwen3-MoE's layout, scaled down): 64 SwiGLU experts of 256, top 8
        num_layers=4, num_heads=8, embed_dim=512, mlp_dim=2048, vocab_size=32000, qkv_bias=False,
        moe={"num_experts": 64, "top_k": 8, "mlp_dim": 256}, seq_len=256,
    ),
}  # fmt: skip
LLAMA = dict(mlp="swiglu", bias=False, norm="rmsnorm", norm_eps=1e-5, positions="rope", tie_embeddings=True,
             dropout=0.0, scan_layers=True)  # fmt: skip

# The source functions (qualified names, as the trace's stack frames give them) whose operations make a part.
# An operation traced inside one of them belongs to that part, whatever it computes; the innermost such
# function decides.
PARTS = {
    "attention": ("Attention._causal", "attention_core", "_core_forward", "_core_backward", "dot_product_attention"),
    "head": ("TransformerLM._logits", "TransformerLM.metrics", "TransformerLM._example_metrics",
             "softmax_cross_entropy_with_integer_labels", "Embed.attend", "TransformerLM._embed", "head_logits",
             "tied_logits", "token_cross_entropy", "_chunked_forward", "_chunked_backward", "_chunked",
             "_blocked_pass", "_blocked_backward", "_blocked", "_block_logits"),
    "optimizer": ("update_fn", "apply_updates", "tree_norm", "tree_update_moment", "_means", "safe_increment",
                  "train_step.<locals>.<dictcomp>"),
}  # fmt: skip
SCOPES = {"attention": "attention"}  # a part's `jax.named_scope` in the operations' names (`.../jvp(attention)/...`):
# under the layer scan, a custom VJP's operations (the CPU's packed residuals) keep only the scan body's frame
LAYERS = ("Block._forward",)  # the layers: their operations are not the head's, though `metrics` called them
MOVES = {"transpose", "copy", "concatenate", "pad", "slice", "reshape", "bitcast", "broadcast", "reverse", "gather",
         "copy-start", "copy-done", "iota"}  # fmt: skip
SCAN = {"dynamic-update-slice", "dynamic-slice"}
SCANNING = ("_scan_apply", "Scan._run")  # where the layer scan's own buffers are made
CONTROL = {"while", "call", "conditional", "async-start", "async-done"}  # contain other operations' time
ORDER = ("matmuls", "attention", "head", "transposes/copies", "scan residuals", "optimizer", "other", "unattributed")


def build(shape: str, lora: bool, seq_len: int | None = None, layers: int | None = None,
          extra: dict | None = None) -> tuple[Any, dict]:  # fmt: skip
    """The model's builder and its options on `shape` (with `seq_len` and `layers` if given, and the `extra`
    options: `dtype`, `quantize`), with or without LoRA."""
    from nnx_cli.models import TransformerLM

    options = {**LLAMA, **SHAPES[shape], **({"num_layers": layers} if layers else {}), **(extra or {})}
    length = options.pop("seq_len") if seq_len is None else (options.pop("seq_len"), seq_len)[1]
    if lora:
        options["lora"] = {"rank": 16, "alpha": 32}
    return (lambda ctx: TransformerLM((length,), None, **options, ctx=ctx)), {**options, "seq_len": length}


def make_step(shape: str, lora: bool, batch: int, seq_len: int | None = None, layers: int | None = None,
              extra: dict | None = None):  # fmt: skip
    """A jitted train step of the trainer, its initial state, its metric sums and a batch of random tokens."""
    from nnx_cli import steps

    seed = 0
    builder, options = build(shape, lora, seq_len, layers, extra)
    tx = optax.adamw(1e-4, weight_decay=0.0)
    moduledef, state = jax.jit(lambda: steps.init_state(builder, tx, seed), static_argnums=())()
    if steps.FROZEN in state:  # as the trainer holds them (a 16-bit base as its bits on a CPU)
        state[steps.FROZEN] = steps.frozen_as_bits(state[steps.FROZEN])
    names = ["loss", "accuracy"]
    sums = steps.empty_sums(names)
    tokens = np.random.default_rng(seed).integers(0, options["vocab_size"], (batch, options["seq_len"] + 1))
    step = jax.jit(
        lambda state, sums, batch: steps.train_step(moduledef, tx, "loss", 0, state, sums, batch), donate_argnums=(0,)
    )
    return step, state, sums, {"tokens": jnp.asarray(tokens, jnp.int32)}, options


def time_steps(step, state, sums, batch, n: int) -> tuple[list[float], Any]:
    """Seconds of each of `n` steps (each waited for)."""
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        state, sums, loss = step(state, sums, batch)
        loss.block_until_ready()
        seconds.append(time.perf_counter() - start)
    return seconds, state


# Reading the trace
# ------------------------------------------------------------------------------


def _table(hlo: str, title: str) -> dict[int, dict[str, str]]:
    """A `title` table of the module's text (`FileNames`, `FunctionNames`, `FileLocations`, `StackFrames`)."""
    table, inside = {}, False
    for line in hlo.splitlines():
        if line == title:
            inside = True
        elif inside and re.match(r"^\d+ ", line):
            number, rest = line.split(" ", 1)
            table[int(number)] = dict(re.findall(r"(\w+)=(\w+)", rest)) if rest.startswith("{") else {"": rest}
        elif inside:
            break
    return table


class Classifier:
    """Puts each instruction of a compiled module into a part, from the source functions it was traced in
    (the module's stack frames) and what it computes (its opcode, or the opcodes of the computation it fuses)."""

    def __init__(self, hlo: str):
        functions = {k: v[""].strip('"') for k, v in _table(hlo, "FunctionNames").items()}
        locations = {k: functions.get(int(v["function_name_id"]), "") for k, v in _table(hlo, "FileLocations").items()}
        self.frames = {k: (locations.get(int(v["file_location_id"]), ""), int(v["parent_frame_id"]))
                       for k, v in _table(hlo, "StackFrames").items()}  # fmt: skip
        self.instructions: dict[str, tuple[str, str, int]] = {}  # name -> (opcode, computation it calls, frame)
        self.computations: dict[str, list[str]] = collections.defaultdict(list)  # computation -> its opcodes
        self.descriptions: dict[str, str] = {}  # name -> its shape and op_name
        self.scopes: dict[str, str] = {}  # name -> its op_name (the JAX name stack it was traced under)
        computation = None
        for line in hlo.splitlines():
            header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
            if header:
                computation = header.group(1)
                continue
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
            if not m:
                continue
            name, opcode = m.groups()
            called = re.search(r"calls=%?([\w.\-]+)", line)
            frame = re.search(r"stack_frame_id=(\d+)", line)
            self.instructions[name] = (opcode, called.group(1) if called else "", int(frame.group(1)) if frame else 0)
            shape = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) [\w\-]+\(", line)
            scope = re.search(r'op_name="([^"]*)"', line)
            self.descriptions[name] = f"{shape.group(1) if shape else ''} {scope.group(1) if scope else ''}"
            self.scopes[name] = scope.group(1) if scope else ""
            if computation is not None:
                self.computations[computation].append(opcode)

    def stack(self, frame: int) -> list[str]:
        """The functions of a stack frame, innermost first."""
        out, seen = [], set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            function, parent = self.frames[frame]
            out.append(function)
            frame = parent
        return out

    def describe(self, name: str) -> str:
        """The instruction's result shape, what it fuses, and the JAX operation it came from."""
        _, called, frame = self.instructions.get(name, ("?", "", 0))
        fused = sorted(set(self.computations.get(called, [])) - {"parameter", "constant", "tuple", "get-tuple-element"})
        where = " < ".join(f for f in self.stack(frame)[:3])
        return f"{self.descriptions.get(name, '')} [{' '.join(fused)}] in {where}"

    def is_control(self, name: str) -> bool:
        return self.instructions.get(name, ("",))[0] in CONTROL

    def part(self, name: str) -> str:
        opcode, called, frame = self.instructions.get(name, ("?", "", 0))
        for part, scope in SCOPES.items():
            if re.search(rf"[/(]{scope}[)/]", self.scopes.get(name, "")):
                return part
        for function in self.stack(frame):
            if function in LAYERS:
                break
            for part, names in PARTS.items():
                if any(function == n or function.startswith(n + ".") or function.endswith("." + n) or n in function
                       for n in names):  # fmt: skip
                    return part
        ops = {opcode, *self.computations.get(called, [])} - {"parameter", "constant", "tuple", "get-tuple-element"}
        ops = ops - {"fusion"} if len(ops) > 1 else ops
        if "dot" in ops or "convolution" in ops or opcode == "custom-call":
            return "matmuls"
        stack = self.stack(frame)
        if ops & SCAN or (ops == {"broadcast"} and (not stack or stack[0] in SCANNING)):  # stacking, or its fill
            return "scan residuals"
        if ops and ops <= MOVES | {"convert"}:
            return "transposes/copies"
        return "other"


def profile(step, state, sums, batch, steps: int, top_ops: int = 10) -> tuple[dict, list[tuple], float | None]:
    """Seconds per part and the most expensive operations, per step, from a `jax.profiler` trace; on a GPU also
    the seconds a step kept the device busy (kernels and copies, overlaps once). The traced steps' wall time is
    the tracer's too: :func:`time_steps` times untraced ones."""
    from jax.profiler import ProfileData

    hlo = step.lower(state, sums, batch).compile().as_text()
    classifier = Classifier(hlo)
    with tempfile.TemporaryDirectory(prefix="nnx-profile-") as directory:  # the trace is read, then removed
        with jax.profiler.trace(directory):
            for _ in range(steps):
                state, sums, loss = step(state, sums, batch)
                loss.block_until_ready()
        (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        planes = list(ProfileData.from_file(path).planes)
    # On a GPU the kernels' own planes (`/device:GPU:N`) hold the time the device spent; the host's planes hold
    # the launches. On a CPU the host's threads run the operations themselves.
    devices = [plane for plane in planes if plane.name.startswith("/device:")]
    parts: dict[str, float] = collections.Counter()
    ops: dict[str, float] = collections.Counter()
    intervals: list[tuple[int, int]] = []
    for plane in devices or planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if devices:
                    intervals.append((event.start_ns, event.start_ns + event.duration_ns))
                name = stats.get("hlo_op") or (f"kernel {event.name[:80]}" if devices else None)
                if name is None or classifier.is_control(name):
                    continue
                seconds = event.duration_ns / 1e9 / steps
                parts[classifier.part(name) if name in classifier.instructions else "unattributed"] += seconds
                ops[name] += seconds
    busy = None
    if intervals:  # the time some kernel or copy ran on the device, overlaps counted once
        busy, end = 0, None
        for start, stop in sorted(intervals):
            if end is None or start > end:
                busy, end = busy + stop - start, stop
            elif stop > end:
                busy, end = busy + stop - end, stop
        busy = busy / 1e9 / steps
    top = [(s, n, classifier.part(n), classifier.describe(n)) for n, s in ops.most_common(top_ops)]
    return dict(parts), top, busy


def load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--lora", action="store_true", help="LoRA rank 16 on all seven projections (else full)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the shape's (256; held-out 512)")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (30; held-out 12)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-steps", type=int, default=3, help="untraced steps whose median wall time is quoted")
    parser.add_argument("--trace-steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=10, help="list this many of the most expensive operations")
    parser.add_argument("--details", action="store_true", help="with each operation, its shape, fused ops, source")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model.dtype")
    parser.add_argument("--quantize", choices=("nf4", "fp4", "bfloat16"), help="model.quantize's type (with --lora)")
    parser.add_argument("--remat", choices=("none", "dots", "full"), default="none", help="model.remat")
    parser.add_argument("--unrolled", action="store_true", help="model.scan_layers=false: the layers unrolled")
    parser.add_argument("--dropout", type=float, default=0.0, help="model.dropout (the recipes train with 0.2)")
    parser.add_argument("--loss-chunk-mb", type=int, help="float32 logits per chunk of the head and loss (64)")
    parser.add_argument("--loss-keep-mb", type=int, help="logits' gradient kept for the head's (0: none)")
    args = parser.parse_args()
    from nnx_cli.models.transformer import loss

    if args.loss_chunk_mb:  # a trade of memory for speed to measure: fewer, larger head products
        loss.CHUNK_BYTES = args.loss_chunk_mb << 20
    if args.loss_keep_mb is not None:  # 0: the head's gradient computes each chunk's (block's) logits again
        loss.KEEP_BYTES = args.loss_keep_mb << 20
    extra = {
        "dtype": args.dtype,
        "remat": args.remat,
        "scan_layers": not args.unrolled,
        "dropout": args.dropout,
        **({"quantize": {"type": args.quantize}} if args.quantize else {}),
    }
    step, state, sums, batch, options = make_step(args.shape, args.lora, args.batch, args.seq_len, args.layers, extra)
    what = "LoRA r16" if args.lora else "full fine-tuning"
    print(f"{args.shape} shape, {what}, batch {args.batch}, sequence {options['seq_len']}, "
          f"load average {load_average():.2f}")  # fmt: skip
    _, state = time_steps(step, state, sums, batch, args.warmup)
    seconds, state = time_steps(step, state, sums, batch, args.time_steps)  # untraced: the wall time quoted
    parts, top, busy = profile(step, state, sums, batch, args.trace_steps, args.top)
    wall = float(np.median(seconds))
    total = sum(parts.values())
    tokens = args.batch * options["seq_len"] / wall
    where = f"{busy * 1e3:.1f} ms with the device busy ({busy / wall:.0%})" if busy else "summed over threads"
    print(f"\none step: {wall * 1e3:.1f} ms wall (median of {args.time_steps} untraced) ({tokens:,.0f} tokens/s), "
          f"{total * 1e3:.1f} ms of XLA operations ({where})\n")  # fmt: skip
    print("| part | ms | share |\n| --- | --- | --- |")
    for part in ORDER:
        print(f"| {part} | {parts.get(part, 0.0) * 1e3:.2f} | {parts.get(part, 0.0) / total:.1%} |")
    print("\nmost expensive operations:")
    for s, name, part, description in top:
        print(f"  {s * 1e3:8.2f} ms  {name}  ({part})" + (f"  {description}" if args.details else ""))


if __name__ == "__main__":
    main()
