"""GPT training on a GPU: `nnx-train` against PyTorch (`torch.compile`, bfloat16 autocast) in the same call.

Two figures, each side a whole process (benchmarks/reference/torch_gpt.py is PyTorch's):

- `gpt2`: GPT-2 small (12 layers, 12 heads of 64, 768 wide, context 1,024, batch 16, vocabulary 50,304,
  bfloat16, no dropout) on the byte stream of `--data`: steady tokens/s and model-FLOPs utilisation (model
  FLOPs per token, 6 N + 12 layers length width with N the weights of the blocks and of the tied head, times
  tokens/s, over the bfloat16 matmul rate measured in the same call on an 8192-cube product), and proof of
  the attention that ran: the compiled train step
  (dumped by XLA) holds cuDNN's fused attention (`__cudnn$fmha` custom calls), and run.json says which
  `model.attention` chose. Target: at least 45% (torch.compile reached 43% on an H100).
- `shakespeare`: `configs/shakespeare_char.yaml` (6 layers, 384 wide, context 256, batch 64, dropout 0.2)
  in bfloat16, 5,000 steps: the validation loss (target at most 1.34 nats per byte) and tokens/s (target at
  least 1.5x PyTorch's on the same recipe).

Prints one table; `--tiny` shrinks every model and run to smoke-test the script on a CPU.

    python benchmarks/gpt.py --data .data/shakespeare [--figures gpt2,shakespeare] [--reference PYTHON]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TORCH_GPT = ROOT / "benchmarks" / "reference" / "torch_gpt.py"
GPT2 = dict(layers=12, heads=12, width=768, length=1024, batch=16, vocab=50304, steps=120)
SHAKESPEARE = dict(layers=6, heads=6, width=384, length=256, batch=64, steps=5000)
TINY_GPT2 = dict(layers=2, heads=2, width=64, length=64, batch=4, vocab=50304, steps=8)
TINY_SHAKESPEARE = dict(layers=1, heads=2, width=64, length=64, batch=8, steps=20)
TARGET_MFU, TARGET_LOSS, TARGET_SPEEDUP = 0.45, 1.34, 1.5


def run(command: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> str:
    """A whole process; its stdout. Its stderr goes to ours as it comes, so that the log of a run cut off by a
    time limit shows how far it got; a failure ends the figure."""
    done = subprocess.run(
        [str(c) for c in command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=env or dict(os.environ),
        timeout=timeout,
    )
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, command))} failed ({done.returncode}): its output is above")
    return done.stdout


def matmul_peak() -> float:
    """FLOP/s of a bfloat16 8192-cube product on JAX's device (the fastest of 10), in a process of its own."""
    code = (
        "import time, jax, jax.numpy as jnp\n"
        "n = 8192 if jax.default_backend() == 'gpu' else 1024\n"
        "a = jnp.ones((n, n), jnp.bfloat16); f = jax.jit(lambda a: a @ a); f(a).block_until_ready()\n"
        "best = min((lambda s: (f(a).block_until_ready(), time.perf_counter() - s)[1])(time.perf_counter())"
        " for _ in range(10))\n"
        "print(2 * n**3 / best)\n"
    )
    return float(run([sys.executable, "-c", code]).strip().splitlines()[-1])


def nnx_train(overrides: list[str], workdir: Path, config: Path, env: dict[str, str]) -> dict:
    """`nnx-train CONFIG OVERRIDES`: its median steady tokens/s (the logs after the first, which holds the
    compiling), last eval loss, peak device memory, and run.json's attention."""
    start = time.perf_counter()
    run([BIN / "nnx-train", config, *overrides, "--workdir", workdir, "--no-resume"], env)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r["metrics"] for r in records if r["split"] == "train"]
    evals = [r["metrics"] for r in records if r["split"] == "eval"]
    rates = [m["tokens_per_s"] for m in train[1:]] or [train[-1]["tokens_per_s"]]
    return {
        "tokens_per_s": statistics.median(rates),
        "val_loss": evals[-1]["loss"] if evals else None,
        "peak_memory_gb": max((m.get("device_peak_gb", 0.0) for m in train), default=None),
        "attention": json.loads((workdir / "run.json").read_text()).get("attention"),
        "seconds": seconds,
    }


def fused_attention_calls(dump: Path) -> int:
    """cuDNN fused-attention calls in the optimised programs XLA dumped (the train step's among them)."""
    return sum(
        p.read_text(errors="replace").count('custom_call_target="__cudnn$fmha')
        for p in dump.rglob("*after_optimizations.txt")
    )


def torch_gpt(reference: str, shape: dict, extra: list[str], tiny: bool) -> dict:
    command = [reference, TORCH_GPT, *(f"--{k}={v}" for k, v in shape.items()), *extra]
    if tiny:
        command += ["--no-compile", "--device=cpu", "--warmup=2"]
    return json.loads(run(command).strip().splitlines()[-1])


def gpt2(args, tmp: Path) -> list[tuple]:
    shape = TINY_GPT2 if args.tiny else GPT2
    config = tmp / "gpt2.yaml"
    config.write_text(
        "model: {name: transformer_lm, dropout: 0.0, dtype: bfloat16}\n"
        f"data: {{source: {args.data}, text_key: text, tokenizer: bytes, eval_split: null}}\n"
        "optimizer: {name: adamw, learning_rate: 3.0e-4, weight_decay: 0.1, weight_decay_mask: kernels}\n"
    )
    steps = shape["steps"]
    overrides = [
        f"model.num_layers={shape['layers']}", f"model.num_heads={shape['heads']}", f"model.embed_dim={shape['width']}",
        f"model.vocab_size={shape['vocab']}", f"data.seq_len={shape['length']}", f"train.batch_size={shape['batch']}",
        f"train.steps={steps}", f"train.log_every={max(1, steps // 6)}", f"checkpoint.every_steps={steps}",
    ]  # fmt: skip
    dump = tmp / "hlo"
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
    ours = nnx_train(overrides, tmp / "gpt2", config, env)
    print(f"nnx-train: {ours}", file=sys.stderr, flush=True)  # kept should PyTorch's side fail
    calls = fused_attention_calls(dump)
    theirs = torch_gpt(args.reference, {**shape, "steps": steps}, ["--random"], args.tiny)
    peak = matmul_peak()
    # transformer_lm.flops_per_token's count (the same architecture), plus the tied head's product, which that
    # leaves out with the embeddings: nanoGPT's convention, in which torch.compile's 43% was stated
    flops = theirs["flops_per_token"] + 6 * shape["vocab"] * shape["width"]
    mfu = lambda tokens_per_s: tokens_per_s * flops / peak  # noqa: E731
    name = f"GPT {shape['layers']}L {shape['width']} ctx {shape['length']} batch {shape['batch']} bf16"
    return [
        (f"{name}: tokens/s", f"{ours['tokens_per_s']:,.0f}", f"{theirs['tokens_per_s']:,.0f}",
         f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x", ""),
        (f"{name}: model-FLOPs utilisation of {peak / 1e12:.0f} TFLOP/s measured",
         f"{mfu(ours['tokens_per_s']):.1%}", f"{mfu(theirs['tokens_per_s']):.1%}", "",
         f">= {TARGET_MFU:.0%}: {'met' if mfu(ours['tokens_per_s']) >= TARGET_MFU else 'MISSED'}"),
        (f"{name}: peak device memory GB", f"{ours['peak_memory_gb'] or 0:.1f}", f"{theirs['peak_memory_gb'] or 0:.1f}",
         "", ""),
        (f"{name}: attention", f"{ours['attention']}; {calls} cuDNN fused-attention calls in the compiled programs",
         "flash (scaled_dot_product_attention)", "", "cudnn taken" if calls else "no fused kernel in the step"),
    ]  # fmt: skip


def shakespeare(args, tmp: Path) -> list[tuple]:
    shape = TINY_SHAKESPEARE if args.tiny else SHAKESPEARE
    overrides = [f"data.source={args.data}", "model.dtype=bfloat16", f"train.steps={shape['steps']}"]
    if args.tiny:
        overrides += [f"model.num_layers={shape['layers']}", f"model.num_heads={shape['heads']}",
                      f"model.embed_dim={shape['width']}", f"data.seq_len={shape['length']}",
                      f"train.batch_size={shape['batch']}", "train.log_every=5", "train.eval_every=10",
                      "train.eval_max_batches=2", "checkpoint.every_steps=20",
                      "optimizer.learning_rate.warmup_steps=5"]  # fmt: skip
    ours = nnx_train(overrides, tmp / "shakespeare", ROOT / "configs" / "shakespeare_char.yaml", dict(os.environ))
    print(f"nnx-train: {ours}", file=sys.stderr, flush=True)
    extra = [f"--data={args.data}", "--dropout=0.2", f"--steps={shape['steps']}"]
    extra += ["--eval-windows=16"] if args.tiny else []
    theirs = torch_gpt(args.reference, {k: v for k, v in shape.items() if k != "steps"}, extra, args.tiny)
    speedup = ours["tokens_per_s"] / theirs["tokens_per_s"]
    loss_ok = ours["val_loss"] is not None and ours["val_loss"] <= TARGET_LOSS
    name = f"shakespeare_char bf16, {shape['steps']} steps"
    return [
        (f"{name}: tokens/s", f"{ours['tokens_per_s']:,.0f}", f"{theirs['tokens_per_s']:,.0f}", f"{speedup:.2f}x",
         f">= {TARGET_SPEEDUP}x: {'met' if speedup >= TARGET_SPEEDUP else 'MISSED'}"),
        (f"{name}: validation nats/byte", f"{ours['val_loss']:.4f}", f"{theirs['val_loss']:.4f}", "",
         f"<= {TARGET_LOSS}: {'met' if loss_ok else 'MISSED'}"),
        (f"{name}: whole run s", f"{ours['seconds']:.0f}", f"{theirs['seconds']:.0f}", "", ""),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / ".data" / "shakespeare"), help="a text dataset directory")
    parser.add_argument("--figures", default="gpt2,shakespeare")
    parser.add_argument("--reference", default=sys.executable, help="a Python with torch (the GPU machine's own)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and runs, on the CPU: a smoke test")
    args = parser.parse_args()
    args.data = str(Path(args.data).resolve())
    figures = {"gpt2": gpt2, "shakespeare": shakespeare}
    unknown = sorted(set(args.figures.split(",")) - set(figures))
    if unknown:
        parser.error(f"--figures: unknown {', '.join(unknown)}; choose from {', '.join(figures)}")
    # each figure's rows as soon as it is done, so that a run cut off by its time limit keeps the earlier ones
    print("| figure | nnx | PyTorch | ratio | target |")
    print("| --- | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory(prefix="nnx-gpt-") as tmp:
        for name in args.figures.split(","):
            try:
                rows = figures[name](args, Path(tmp))
            except (SystemExit, subprocess.TimeoutExpired) as failure:  # the next figure still runs
                print(failure, file=sys.stderr, flush=True)
                rows = [(name, "failed (its log above)", "", "", "")]
            for row in rows:
                print("| " + " | ".join(row) + " |", flush=True)
            print(f"{name} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
