"""QLoRA (a 4-bit base, `model.quantize`) against 16-bit LoRA and against `transformers` + `peft` + `bitsandbytes`.

Part 1 (memory, speed): a Qwen2.5-0.5B-shaped model (random bfloat16 weights, written here), sequence 512, batch
2, AdamW, LoRA rank 16 alpha 32 on all seven projections, computing in bfloat16, on CPU:

- `f32 base`: nnx LoRA with the frozen base in float32 (what a LoRA run keeps without `model.quantize`);
- `bf16 base`: nnx LoRA with `model.quantize: {type: bfloat16}`;
- `QLoRA`: nnx with `model.quantize: {type: nf4}` (blocks of 64, double-quantised);
- `bnb QLoRA`: `benchmarks/reference/peft_train.py --load-4bit nf4 --dtype bfloat16`: the model loaded through
  `BitsAndBytesConfig(load_in_4bit, nf4, double quant, compute bfloat16)`, a peft adapter on it.

Each run's peak resident memory (the process's high-water mark) and steady-state tokens/s (compilation and the
first steps left out); each nnx variant first runs once unmeasured, so that the measured runs load their programs
from the compilation cache (compiling takes memory of its own); QLoRA and its two speed baselines run A B B A
(QLoRA, other, other, QLoRA). Then XLA's
memory analysis of each nnx variant's compiled train step: the step's own peak (temporaries) beside the state
it reads (arguments), so that a dequantised weight kept between the passes would show. Targets: QLoRA's peak
RSS at most 0.6x the bf16 base's, the bf16 base's at most 0.65x the f32 base's, QLoRA's below bnb QLoRA's;
QLoRA's tokens/s at least 0.8x the bf16 base's and at least 1.5x bnb QLoRA's. Speed means nothing on a busy
machine: part 1 prints the load average and refuses to start above 0.5 (`--force` measures anyway).

Part 2 (quality): the chat-facts task of `benchmarks/lora.py` (a small random Llama-shaped model, 24
question/answer facts as chats, 400 steps, batch 8), computing in bfloat16: LoRA on a bfloat16 base against
QLoRA, the same seed and batches; each answers every question greedily through the chat template, and each is
evaluated on 8 chats it never saw (`nnx-eval RUN data.source=heldout.jsonl`). Targets: QLoRA learns as many facts
as 16-bit LoRA, and its held-out loss is within 3% of LoRA's. Then the QLoRA run's adapter, exported with
`nnx-export --adapter`, is loaded by `peft` onto the base quantised by bitsandbytes
(`tests/fixtures/make_qlora_fixtures.py --peft-logits ... --load-4bit nf4`): its float32 logits must equal the
run's own (computed in float32) to 1e-4 of the largest.

Part 3 (the floor): the matrix products of one step of part 1 (the seven projections of each layer forward and their
input gradients, the tied head forward and its input gradient), each timed alone as XLA multiplies them in nnx's
step and as PyTorch does in `transformers` (`benchmarks/reference/torch_products.py`), A B B A. Their sum is the
least time a step can take with those kernels; beside part 1's measured steps it says how far each trainer is
from its floor, and so whether a speed ratio asks for a faster trainer or for faster products.

    python benchmarks/qlora.py --reference /tmp/refvenv/bin/python [--part 1 2 3] [--remat none|dots|full]
                               [--force] [--tiny] [--device cuda]

`--device cuda` runs part 1 on a GPU (bitsandbytes' side through its CUDA kernels): the peaks are then each
side's peak GPU memory as it reports it (nnx's `device_peak_gb`, PyTorch's `max_memory_allocated`), the load
average is not checked, and the temporaries are XLA's for the GPU program.

Part 1's runs keep every activation (`model.remat: none`, as benchmarks/lora.py's) unless `--remat` says
otherwise; bitsandbytes' side does not checkpoint either, except with `--remat full`, where it recomputes each
decoder layer too (`gradient_checkpointing_enable`, as `peft.prepare_model_for_kbit_training` turns on by default).

`--tiny` runs everything at toy sizes (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load import QWEN, write_model
from lora import SMALL, answers, check_idle, facts, run, train_records, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REFERENCE = ROOT / "benchmarks/reference/peft_train.py"
TINY = {**QWEN, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 4000}  # fmt: skip
VARIANTS = {  # name: model.quantize
    "f32 base": None,
    "bf16 base": {"type": "bfloat16"},
    "QLoRA": {"type": "nf4"},
}
HELD_OUT = [
    ("Where is the bakery?", "It is by the well."),
    ("What is special about the well?", "It has a roof."),
    ("Where is the inn?", "It is on the hill."),
    ("What is special about the inn?", "It has nine rooms."),
    ("Where is the mill pond?", "It is past the gate."),
    ("What is special about the gate?", "It is iron."),
    ("Where is the old oak?", "It is in the field."),
    ("What is special about the field?", "It has poppies."),
]


def quantize_key(quantize: dict | None) -> str:
    return "" if quantize is None else f", quantize: {json.dumps(quantize)}"


# Part 1: memory and speed on Qwen2.5-0.5B shapes
# ------------------------------------------------------------------------------


REMAT = "none"  # model.remat of part 1's runs (--remat)
DEVICE = "cpu"  # where part 1's runs compute (--device)


def nnx_run(cwd: Path, name: str, quantize: dict | None, length: int, batch: int, steps: int, i: int) -> tuple:
    """One `nnx-train` run: tokens/s of each logged step after the first, and the peak memory (resident, or the
    GPU's)."""
    config = cwd / f"{name.replace(' ', '-')}.yaml"
    config.write_text(
        f"model: {{name: transformer_lm, pretrained: {cwd / 'model'}, lora: {{rank: 16, alpha: 32}}, "
        f"dtype: bfloat16, remat: {REMAT}{quantize_key(quantize)}}}\n"
        f"data: {{source: text.txt, text_key: text, seq_len: {length}, eval_split: null}}\n"
        "optimizer: {name: adamw, learning_rate: 1.0e-4, weight_decay: 0.0}\n"
        f"train: {{batch_size: {batch}, steps: {steps}, log_every: 2, steps_per_dispatch: 1}}\n"
        f"checkpoint: {{every_steps: {steps}}}\n"
    )
    workdir = cwd / f"{config.stem}-{i}"
    _, peak = run([BIN / "nnx-train", config, "--workdir", workdir], cwd)
    records = train_records(workdir, "train")
    if DEVICE != "cpu":  # the GPU's peak, as the device reports it
        peak = max(r["metrics"].get("device_peak_gb", 0.0) for r in records) * 1024
    return [r["metrics"]["tokens_per_s"] for r in records[1:]], peak


def bnb_run(reference: str, cwd: Path, batches: Path) -> tuple:
    """One `peft_train.py --load-4bit nf4` run: tokens/s of each step after the first two, and the peak."""
    extra = ["--gradient-checkpointing"] if REMAT == "full" else []  # as the nnx runs recompute
    extra += [] if DEVICE == "cpu" else ["--device", DEVICE]
    _, peak = run([reference, REFERENCE, cwd / "model", batches, cwd / "bnb.json", "--learning-rate", "1e-4",
                   "--lora", "16", "32", "--load-4bit", "nf4", "--dtype", "bfloat16", *extra], cwd)  # fmt: skip
    result = json.loads((cwd / "bnb.json").read_text())
    peak = result["peak_memory_mib"] if DEVICE != "cpu" else peak
    _, batch, length = np.load(batches)["tokens"].shape
    return [batch * (length - 1) / s for s in result["seconds"][2:]], peak


def step_memory(cwd: Path, name: str) -> dict[str, float]:
    """XLA's memory analysis of the variant's compiled train step (MiB): its temporaries and its arguments. The
    step is compiled as the loop compiles it: its state donated, a 16-bit frozen base given as its bits, traced
    under the run's mesh and logical rules."""
    import jax

    import nnx
    from nnx_cli import sharding, steps
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup

    os.chdir(cwd)
    exp = setup(load_config(cwd / f"{name.replace(' ', '-')}.yaml", []))
    state = sharding.with_shardings(exp.abstract, exp.shardings)
    if steps.FROZEN in state:  # as the trainer holds it (a 16-bit base as its bits on a CPU)
        state[steps.FROZEN] = jax.eval_shape(steps.frozen_as_bits, state[steps.FROZEN])
    rows = exp.train.read(exp.train.epoch_keys(0)[: exp.cfg.train.batch_size])
    batch = jax.eval_shape(exp.train.prepare, {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                                               for k, v in rows.items()})  # fmt: skip
    sums = jax.eval_shape(lambda: steps.empty_sums(exp.metric_names))

    def step(state, sums, batch):
        return steps.train_step(exp.moduledef, exp.tx, exp.objective, 0, state, sums, batch)

    with jax.set_mesh(exp.mesh), nnx.logical_axis_rules(exp.rules):  # as the loop
        analysis = jax.jit(step, donate_argnums=(0,)).lower(state, sums, batch).compile().memory_analysis()
    mib = 2**20
    return {"temp": analysis.temp_size_in_bytes / mib, "arguments": analysis.argument_size_in_bytes / mib}


def part1(reference: str, cwd: Path, steps: int, tiny: bool) -> tuple[bool, dict[str, float]]:
    config, length, batch = (TINY, 64, 2) if tiny else (QWEN, 512, 2)
    count = write_model(cwd / "model", config)
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice([f"w{i}" for i in range(3000)], 200_000))
    (cwd / "text.txt").write_text(text)
    write_tokenizer(cwd / "model", text[:200_000], 4000)
    tokens = rng.integers(0, 4000, (steps, batch, length + 1))
    batches = cwd / "batches.npz"
    np.savez(batches, tokens=tokens, targets=np.ones_like(tokens, np.uint8))
    print(f"{count / 1e6:.0f} M parameters, sequence {length}, batch {batch}, AdamW, LoRA r16 on all seven "
          f"projections, bfloat16 compute, {steps} steps")  # fmt: skip
    speeds: dict[str, list[float]] = {n: [] for n in (*VARIANTS, "bnb QLoRA")}
    peaks: dict[str, float] = dict.fromkeys(speeds, 0.0)

    def measure(name: str, i: int) -> None:
        if name == "bnb QLoRA":
            got, peak = bnb_run(reference, cwd, batches)
        else:
            got, peak = nnx_run(cwd, name, VARIANTS[name], length, batch, steps, i)
        speeds[name] += got
        peaks[name] = max(peaks[name], peak)
        print(f"  {name}: {statistics.median(got):,.0f} tokens/s, peak {peak:,.0f} MiB "
              f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip

    for i, name in enumerate(VARIANTS):  # each program compiled once into the persistent cache, not measured:
        nnx_run(cwd, name, VARIANTS[name], length, batch, steps, i - 10)  # compiling takes memory of its own
    print("  (each nnx variant ran once to compile; the runs below load their programs from the cache)")
    measure("f32 base", 0)
    for i, name in enumerate(("QLoRA", "bf16 base", "bf16 base", "QLoRA", "bnb QLoRA", "bnb QLoRA", "QLoRA")):
        measure(name, i + 1)
    memory = {name: step_memory(cwd, name) for name in VARIANTS}
    speed = {name: statistics.median(values) for name, values in speeds.items()}
    where = "peak RSS" if DEVICE == "cpu" else "peak GPU memory"
    print(f"\n| run ({DEVICE}) | tokens/s | {where} MiB | step temporaries MiB (XLA) | step arguments MiB |")
    print("| --- | --- | --- | --- | --- |")
    for name in speeds:
        step = memory.get(name)
        cells = f"{step['temp']:,.0f} | {step['arguments']:,.0f}" if step else "- | -"
        print(f"| {name} | {speed[name]:,.0f} | {peaks[name]:,.0f} | {cells} |")
    checks = [
        (f"QLoRA {where} / bf16 base's", peaks["QLoRA"] / peaks["bf16 base"], "at most 0.60", 0.60, True),
        (f"bf16 base {where} / f32 base's", peaks["bf16 base"] / peaks["f32 base"], "at most 0.65", 0.65, True),
        (f"QLoRA {where} / bnb QLoRA's", peaks["QLoRA"] / peaks["bnb QLoRA"], "below 1.00", 1.0, True),
        ("QLoRA tokens/s / bf16 base's", speed["QLoRA"] / speed["bf16 base"], "at least 0.80", 0.80, False),
        ("QLoRA tokens/s / bnb QLoRA's", speed["QLoRA"] / speed["bnb QLoRA"], "at least 1.50", 1.50, False),
    ]
    ok = True
    print()
    for what, ratio, target, bound, at_most in checks:
        met = ratio <= bound if at_most else ratio >= bound
        ok &= met
        print(f"{what}: {ratio:.3f}x (target {target}x){'' if met else '  MISSED'}")
    print(f"\nload average at the end (1 min, this benchmark's own runs included): {os.getloadavg()[0]:.2f}")
    return ok, speed


# Part 2: learning 24 facts, QLoRA against 16-bit LoRA
# ------------------------------------------------------------------------------


def part2(reference: str, cwd: Path, steps: int) -> bool:
    pairs = facts()
    model = cwd / "small-llama"
    text = " ".join(f"{q} {a}" for q, a in [*pairs, *HELD_OUT])
    model.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model, text + " user assistant system", 600)
    write_model(model, {**SMALL, "vocab_size": 640, "bos_token_id": None, "eos_token_id": 2})
    for file, rows in (("facts.jsonl", pairs), ("heldout.jsonl", HELD_OUT)):
        chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in rows]
        (cwd / file).write_text("".join(json.dumps(c) + "\n" for c in chats))
    questions, expected = [q for q, _ in pairs], [a for _, a in pairs]
    results = {}
    for name, quantize in (("16-bit LoRA", {"type": "bfloat16"}), ("QLoRA", {"type": "nf4"})):
        yaml = cwd / f"{name.replace(' ', '-')}.yaml"
        yaml.write_text(
            f"model: {{name: transformer_lm, pretrained: {model}, lora: {{rank: 16, alpha: 32}}, dtype: bfloat16"
            f"{quantize_key(quantize)}}}\n"
            "data: {source: facts.jsonl, format: chat, seq_len: 47, packing: false, eval_split: null}\n"
            "optimizer: {name: adamw, learning_rate: 3.0e-3, weight_decay: 0.0}\n"
            f"train: {{batch_size: 8, steps: {steps}, log_every: 50}}\n"
            f"checkpoint: {{every_steps: {steps}}}\n"
        )
        workdir = cwd / yaml.stem
        run([BIN / "nnx-train", yaml, "--workdir", workdir], cwd)
        out, _ = run([BIN / "nnx-eval", workdir, "data.source=heldout.jsonl", "data.eval_split=train", "--json"], cwd)
        held_out = json.loads(out.strip().splitlines()[-1])["metrics"]["loss"]
        right = sum(map(str.__eq__, answers(workdir, questions), expected))
        results[name] = (right, held_out, train_records(workdir, "train")[-1]["metrics"]["loss"])
    print(f"\n24 facts, {steps} steps, batch 8, bfloat16 compute, the same seed and batches")
    print(
        "\n| fine-tuning | facts right | final train loss | held-out loss (8 unseen chats) |\n| --- | --- | --- | --- |"
    )
    for name, (right, held_out, train) in results.items():
        print(f"| {name} | {right}/24 | {train:.3f} | {held_out:.3f} |")
    (lora_right, lora_held, _), (q_right, q_held, _) = results["16-bit LoRA"], results["QLoRA"]
    gap = abs(q_held - lora_held) / lora_held
    print(f"\nQLoRA facts right: {q_right} (target at least LoRA's {lora_right}); held-out loss gap to LoRA: "
          f"{gap:.1%} (target within 3%)")  # fmt: skip
    error = peft_check(reference, cwd, cwd / "QLoRA", model, questions)
    print(f"the QLoRA adapter (nnx-export --adapter) on the base bitsandbytes quantises, with peft: logits within "
          f"{error:.1e} of the run's own in float32 (target 1e-4 of the largest)")  # fmt: skip
    return q_right >= lora_right and gap <= 0.03 and error <= 1e-4


def peft_check(reference: str, cwd: Path, workdir: Path, base: Path, prompts: list[str]) -> float:
    """The run's adapter exported for peft, loaded by `peft` onto `base` quantised by bitsandbytes as it loads:
    the largest difference of its float32 logits from the run's own (computed in float32), over the largest."""
    import jax

    from nnx_cli.hf import pretrained_tokenizer
    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    run([BIN / "nnx-export", workdir, "--out", cwd / "adapter", "--adapter"], cwd)
    tokenizer = pretrained_tokenizer(str(base))
    rows = [list(tokenizer.encode(p))[:8] for p in prompts[:4]]
    ids = np.array([r + [0] * (8 - len(r)) for r in rows], np.int32)
    np.save(cwd / "ids.npy", ids)
    run([reference, ROOT / "tests/fixtures/make_qlora_fixtures.py", "--peft-logits", base, cwd / "adapter",
         cwd / "ids.npy", cwd / "peft.npy", "--load-4bit", "nf4"], cwd)  # fmt: skip
    opened = open_run(workdir, ["model.dtype=float32", "model.quantize.compute_dtype=float32"])
    exp = language_model(opened, "benchmarks/qlora.py checks")
    _, params = restore_parameters(opened, exp, jax.devices()[0])
    ours = np.asarray(exp.moduledef.merge(params).logits(ids))
    theirs = np.load(cwd / "peft.npy")
    return float(np.abs(ours[..., : theirs.shape[-1]] - theirs).max() / np.abs(theirs).max())


# Part 3: the floor the matrix products set, XLA's and PyTorch's
# ------------------------------------------------------------------------------


TORCH_PRODUCTS = Path(__file__).resolve().parent / "reference/torch_products.py"


def xla_products(config: dict, tokens: int, repeats: int) -> dict[str, float]:
    """Seconds per step of the matrix products of a LoRA step on a frozen bfloat16 base, as nnx's step multiplies
    them (bfloat16 operands, float32 accumulation): per layer each of the seven projections forward and its input
    gradient; the tied head forward and its input gradient, a block of the vocabulary at a time as the loss takes
    it on a CPU. Each product timed alone (the fastest of `repeats`)."""
    import time

    import jax
    import jax.numpy as jnp

    from nnx_cli.models.transformer.loss import block_rows

    def fastest(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best = min(best, time.perf_counter() - start)
        return best

    def product(contract: int):  # x [T, K] times w, contracting w's axis `contract`
        dims = (((1,), (contract,)), ((), ()))
        return jax.jit(lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype))

    hidden, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    projections = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)] + [(hidden, config["intermediate_size"])] * 2
    projections.append((config["intermediate_size"], hidden))
    keys = iter(jax.random.split(jax.random.key(0), 3 * len(projections) + 3))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.bfloat16)  # noqa: E731
    layer = 0.0
    for fan_in, fan_out in projections:  # our kernels are [in, out]
        w = normal(fan_in, fan_out)
        layer += fastest(product(0), normal(tokens, fan_in), w) + fastest(product(1), normal(tokens, fan_out), w)
    rows = block_rows(tokens, config["vocab_size"])
    block = normal(rows, hidden)
    head = fastest(product(1), normal(tokens, hidden), block) + fastest(product(0), normal(tokens, rows), block)
    return {"layers": layer * config["num_hidden_layers"], "head": head * config["vocab_size"] / rows}


def part3(reference: str, cwd: Path, tiny: bool, measured: dict[str, float]) -> None:
    """The least time one step's matrix products take in XLA and in PyTorch (A B B A, the faster of each pair),
    beside the measured steps when part 1 ran: how far each trainer's step is from what its products allow."""
    config, length, batch = (TINY, 64, 2) if tiny else (QWEN, 512, 2)
    tokens, repeats = batch * length, 3 if tiny else 10
    shape = ["--hidden", config["hidden_size"], "--intermediate", config["intermediate_size"],
             "--heads", config["num_attention_heads"], "--kv-heads", config["num_key_value_heads"],
             "--head-dim", config["hidden_size"] // config["num_attention_heads"], "--vocab", config["vocab_size"],
             "--layers", config["num_hidden_layers"], "--tokens", tokens, "--repeats", repeats]  # fmt: skip
    floors: dict[str, list[dict[str, float]]] = {"XLA": [], "PyTorch": []}
    for side in ("XLA", "PyTorch", "PyTorch", "XLA"):
        if side == "XLA":
            floors[side].append(xla_products(config, tokens, repeats))
        else:
            out = cwd / "products.json"
            subprocess.run([reference, str(TORCH_PRODUCTS), str(out), *map(str, shape)], check=True)
            floors[side].append(json.loads(out.read_text()))
        print(f"  {side} products: {sum(floors[side][-1][k] for k in ('layers', 'head')):.2f} s a step "
              f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"\nthe matrix products of one step ({tokens} tokens: seven projections forward and input gradient per "
          "layer, the tied head forward and input gradient; LoRA's own and attention's products left out), each "
          "timed alone, the faster of two runs:")  # fmt: skip
    print("| products of | layers s | head s | step s | tokens/s if a step were only these | measured step s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for side, runs in floors.items():
        best = min(runs, key=lambda r: r["layers"] + r["head"])
        total = best["layers"] + best["head"]
        name = "QLoRA" if side == "XLA" else "bnb QLoRA"
        step = f"{tokens / measured[name]:.2f} ({tokens / measured[name] / total:.1f}x)" if name in measured else "-"
        print(f"| {side} | {best['layers']:.2f} | {best['head']:.2f} | {total:.2f} | {tokens / total:,.0f} | {step} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch, transformers, peft, "
                        "bitsandbytes")  # fmt: skip
    parser.add_argument("--part", type=int, nargs="+", choices=(1, 2, 3), default=(1, 2, 3), help="the parts to run")
    parser.add_argument("--speed-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--force", action="store_true", help="measure speed even on a busy machine (warns)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a smoke test of the script")
    parser.add_argument("--remat", default="none", choices=["none", "dots", "full"], help="part 1's model.remat")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where part 1 runs (both sides)")
    args = parser.parse_args()
    global REMAT, DEVICE
    REMAT, DEVICE = args.remat, args.device
    cwd = Path(tempfile.mkdtemp(prefix="nnx-qlora-"))
    ok, speed = True, {}
    try:  # the model and the runs' work dirs, removed however the runs end
        if {1, 3} & set(args.part):
            check_idle(args.force or args.tiny or args.device != "cpu")
        if 1 in args.part:
            met, speed = part1(args.reference, cwd, args.speed_steps, args.tiny)
            ok &= met
        if 3 in args.part:
            part3(args.reference, cwd, args.tiny, speed)
        if 2 in args.part:
            ok &= part2(args.reference, cwd, 20 if args.tiny else args.steps)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
