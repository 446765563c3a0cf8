"""LoRA and full fine-tuning against `transformers` + `peft`: speed, memory, checkpoint size, and what is learned.

Part 1 (speed, memory, size): a SmolLM2-135M-shaped model (random bfloat16 weights written here, loaded in
float32 by both sides), sequence 256, batch 4, AdamW, CPU; with `--device cuda`, on a GPU in bfloat16 on
both sides (nnx computing in bfloat16, PyTorch with the weights loaded in bfloat16), peak GPU memory
compared. `nnx-train` with LoRA (rank 16, alpha 32, all seven projections) and fully, against
`benchmarks/reference/peft_train.py` doing the same with `peft` and without it. Steady-state training
tokens/s (compilation and the first steps left out) and peak memory (the process's resident high-water
mark) of each; the size of a LoRA checkpoint against a full one. Then the same
on a held-out shape the speed work was not tuned on (`--shapes` picks): Qwen2-like, grouped-query attention
with biases on q, k and v, an untied head, sequence 1024, batch 2. Targets, on both shapes: tokens/s at least
1.0x, peak memory no higher (full fine-tuning's is printed on its own line), a LoRA checkpoint under 5% of a
full one. Each side runs twice, alternating (nnx, theirs, theirs, nnx), and the medians are over both runs'
steps. Speed means nothing on a busy machine: part 1 prints the load average and refuses to start above 0.5
(`--force` measures anyway, warning).

Part 2 (learning): a small random Llama-shaped model with a ChatML template and 24 question/answer facts as
chats. `peft` and nnx start from the same adapter (peft's initialisation, saved and given to nnx through
`checkpoint.init_from`) and see the same batches (nnx's, written out for the reference). Both fine-tune
400 steps with LoRA and fully; each then answers every question greedily through the chat template. Targets:
every fact learnt by LoRA and by full fine-tuning, and nnx's LoRA eval loss within 10% of peft's at every
eval (after the first 100 steps, where both are still near the start).

    python benchmarks/lora.py --reference /tmp/refvenv/bin/python [--part 1|2] [--shapes smollm2,held-out] [--force]
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
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load import write_model

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REFERENCE = ROOT / "benchmarks/reference/peft_train.py"
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
HELD_OUT = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SHAPES = {  # name: (description, config.json, sequence length, batch size)
    "smollm2": ("SmolLM2-135M shapes", SMOLLM2, 256, 4),
    "held-out": ("held out: Qwen2-like, GQA 8/2 with q/k/v biases, untied head", HELD_OUT, 1024, 2),
}
MAX_LOAD = 0.5  # the 1-minute load average above which speed is not measured (see check_idle)
SMALL = {
    **SMOLLM2, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0,
}  # fmt: skip
SHAPES["tiny"] = ("tiny: SmolLM2's, 4 layers 128 wide (a smoke test of the script)", SMALL, 64, 2)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SUBJECTS = ["the mill", "the bridge", "the river", "the fiddler", "the square", "the school", "the harbour",
            "the orchard", "the tower", "the market", "the chapel", "the forge"]  # fmt: skip
ANSWERS = ["north of the town", "the old guard", "every spring", "a red boat", "seven lamps", "Anna Berg",
           "in the cellar", "twelve geese", "the blue door", "on Tuesdays", "a silver bell", "three oaks"]  # fmt: skip


def facts() -> list[tuple[str, str]]:
    """24 question/answer pairs: two questions about each of 12 subjects."""
    out = []
    for i, subject in enumerate(SUBJECTS):
        out.append((f"Where is {subject}?", f"It is {ANSWERS[i]}."))
        out.append((f"What is special about {subject}?", f"It has {ANSWERS[(i + 5) % len(ANSWERS)]}."))
    return out


def write_tokenizer(directory: Path, text: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on `text`, with ChatML special tokens, template and stop token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator([text] * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))


def hwm_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM, kept by the kernel), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Peak:
    """The peak resident memory (MiB) of a process: the kernel's own high-water mark (VmHWM), read every 20 ms
    until it exits. Not PSS: reading smaps_rollup walks the process's page tables under its memory-map lock,
    which slowed the page faults of the runs it measured by up to a third."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.value = proc, 0.0
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.proc.poll() is None:
            self.value = max(self.value, hwm_mib(self.proc.pid) or 0.0)
            time.sleep(0.02)


DEVICE = "cpu"  # --device: where both sides compute (cuda: bfloat16 on both, peak GPU memory compared)


def run(command: list, cwd: Path) -> tuple[str, float]:
    """Run a command; its stdout and its peak resident memory."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"} if DEVICE == "cpu" else dict(os.environ)
    proc = subprocess.Popen([str(c) for c in command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    peak = Peak(proc)
    out, err = proc.communicate()
    peak.thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))} failed:\n{err[-3000:]}")
    return out, peak.value


def train_records(workdir: Path, split: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


# Part 1: speed, memory, checkpoint size on SmolLM2-135M shapes
# ------------------------------------------------------------------------------


def ours(cwd: Path, config: Path, workdir: Path, steps: int) -> tuple[list[float], float, float]:
    """One `nnx-train` run: its steady-state tokens/s of each logged step, its peak memory, its checkpoint's size."""
    _, peak = run([BIN / "nnx-train", config, "--workdir", workdir], cwd)
    records = train_records(workdir, "train")
    speeds = [r["metrics"]["tokens_per_s"] for r in records[1:]]  # after compiling
    if DEVICE != "cpu":  # the GPU's peak, as the device reports it
        peak = max(r["metrics"].get("device_peak_gb", 0.0) for r in records) * 1024
    return speeds, peak, size_mib(workdir / "checkpoints" / str(steps))


def theirs(reference: str, cwd: Path, model: Path, batches: Path, lora: bool) -> tuple[list[float], float, int]:
    """One `peft_train.py` run on `batches`: tokens/s of each step after the first two, peak, threads."""
    extra = ["--lora", "16", "32"] if lora else []
    extra += [] if DEVICE == "cpu" else ["--device", DEVICE, "--dtype", "bfloat16"]
    _, peak = run([reference, REFERENCE, model, batches, cwd / "speed.json", "--learning-rate", "1e-4", *extra],
                  cwd)  # fmt: skip
    result = json.loads((cwd / "speed.json").read_text())
    peak = result["peak_memory_mib"] if DEVICE != "cpu" else peak
    _, batch, length = np.load(batches)["tokens"].shape
    return [batch * (length - 1) / s for s in result["seconds"][2:]], peak, result["threads"]


def check_idle(force: bool) -> None:
    """Print the load average; refuse to measure above MAX_LOAD (with `force`, warn loudly and go on).

    With two cores, torch's threads collapse when another process shares them (steps 5 s -> 30-60 s under a
    load of 4) while XLA slows about 1.8x: a busy machine reads anything from 0.6x to 3.7x.
    """
    load = os.getloadavg()[0]
    print(f"load average (1 min): {load:.2f}")
    if load <= MAX_LOAD:
        return
    message = (f"the machine is busy (load average {load:.2f} > {MAX_LOAD}): speed ratios measured now are "
               "meaningless; run on an idle machine")  # fmt: skip
    if not force:
        raise SystemExit(f"refusing to measure: {message} (or pass --force)")
    print(f"\n{'!' * 100}\nWARNING: {message}. Figures below are NOT comparable.\n{'!' * 100}\n")


def part1(reference: str, cwd: Path, steps: int, shapes: list[str]) -> bool:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(3000)]
    text = " ".join(rng.choice(words, 200_000))
    (cwd / "text.txt").write_text(text)
    print(f"AdamW, {steps} steps; each side runs twice, in the order nnx, theirs, theirs, nnx")
    rows, ok = [], True
    for shape in shapes:
        description, config, length, batch = SHAPES[shape]
        model = cwd / shape
        count = write_model(model, config)
        write_tokenizer(model, text[:200_000], 4000)
        print(f"\n{description} ({count / 1e6:.1f} M parameters), sequence {length}, batch {batch}")
        batches = cwd / f"speed-{shape}.npz"
        tokens = rng.integers(0, 4000, (steps, batch, length + 1))
        np.savez(batches, tokens=tokens, targets=np.ones_like(tokens, np.uint8))
        measured = [speed_row(reference, cwd, model, batches, shape, lora, steps) for lora in (True, False)]
        rows += measured
        full = measured[1]
        print(f"full fine-tuning peak memory ({shape}): nnx {full[4]:,.0f} MiB, theirs {full[5]:,.0f} MiB "
              f"({full[4] / full[5]:.2f}x; target at most 1.00x)")  # fmt: skip
        share = measured[0][6] / measured[1][6]
        print(f"LoRA checkpoint / full checkpoint ({shape}): {share:.1%} (target under 5%)")
        ok &= share < 0.05
    where = "peak RSS MiB" if DEVICE == "cpu" else "peak GPU MiB"
    print(f"\n| shape | fine-tuning | nnx tokens/s | peft/transformers tokens/s | ratio | nnx {where} | "
          "theirs MiB | nnx checkpoint MiB |\n| --- | --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for shape, name, speed, their_speed, peak, their_peak, checkpoint, threads in rows:
        print(f"| {shape} | {name} | {speed:,.0f} | {their_speed:,.0f} ({threads} threads) | "
              f"{speed / their_speed:.2f}x | {peak:,.0f} | {their_peak:,.0f} | {checkpoint:,.1f} |")  # fmt: skip
    print(f"\nload average at the end (1 min, this benchmark's own runs included): {os.getloadavg()[0]:.2f}")
    return ok and all(r[2] >= r[3] and r[4] <= r[5] for r in rows)


def speed_row(reference: str, cwd: Path, model: Path, batches: Path, shape: str, lora: bool, steps: int) -> tuple:
    """LoRA (rank 16, alpha 32, every projection) or full fine-tuning of `model` on both sides, A B B A: `(shape,
    name, nnx tokens/s, theirs, nnx peak MiB, theirs, nnx checkpoint MiB, their threads)`, medians over runs."""
    name = "LoRA r16" if lora else "full"
    _, batch, length = np.load(batches)["tokens"].shape
    config = cwd / f"speed-{shape}-{name[:4]}.yaml"
    config.write_text(
        f"model: {{name: transformer_lm, pretrained: {model}, {'lora: {rank: 16, alpha: 32}, ' if lora else ''}"
        f"scan_layers: true{', dtype: bfloat16' if DEVICE != 'cpu' else ''}}}\n"
        f"data: {{source: text.txt, text_key: text, seq_len: {length - 1}, eval_split: null}}\n"
        "optimizer: {name: adamw, learning_rate: 1.0e-4, weight_decay: 0.0}\n"
        f"train: {{batch_size: {batch}, steps: {steps}, log_every: 2, steps_per_dispatch: 1}}\n"
        f"checkpoint: {{every_steps: {steps}}}\n"
    )
    speeds = {"nnx": [], "theirs": []}
    peaks = {"nnx": 0.0, "theirs": 0.0}
    for i, side in enumerate(("nnx", "theirs", "theirs", "nnx")):  # A B B A: drifting load hits both alike
        if side == "nnx":
            got, peak, checkpoint = ours(cwd, config, cwd / f"speed-{shape}-{name[:4]}-{i}", steps)
        else:
            got, peak, threads = theirs(reference, cwd, model, batches, lora)
        print(f"  {name}, {side}: {statistics.median(got):,.0f} tokens/s, peak {peak:,.0f} MiB "
              f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip
        speeds[side] += got
        peaks[side] = max(peaks[side], peak)
    return (shape, name, statistics.median(speeds["nnx"]), statistics.median(speeds["theirs"]), peaks["nnx"],
            peaks["theirs"], checkpoint, threads)  # fmt: skip


# Part 2: learning 24 facts, with the same start and the same batches
# ------------------------------------------------------------------------------


def part2(reference: str, cwd: Path, steps: int) -> bool:
    from nnx_cli.config import load_config
    from nnx_cli.data import examples

    pairs = facts()
    model = cwd / "small-llama"
    text = " ".join(f"{q} {a}" for q, a in pairs)
    model.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model, text + " user assistant system", 600)
    config = {**SMALL, "vocab_size": 640, "bos_token_id": None, "eos_token_id": 2}
    write_model(model, config)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    (cwd / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = [q for q, _ in pairs]
    (cwd / "questions.json").write_text(json.dumps(questions))
    data = "data: {source: facts.jsonl, format: chat, seq_len: 47, packing: false, eval_split: train}\n"
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={model}", "data.source=facts.jsonl",
                             "data.format=chat", "data.seq_len=47", "data.packing=false",
                             "data.eval_split=train", "data.cache_dir=" + str(cwd / "cache")])  # fmt: skip
    os.chdir(cwd)
    splits = examples.load_example_splits(cfg.data, seed=0, pretrained=str(model))
    batch, per_epoch = 8, len(splits.train) // 8
    keys = [splits.train.epoch_keys(s // per_epoch)[(s % per_epoch) * batch : (s % per_epoch + 1) * batch]
            for s in range(steps)]  # fmt: skip
    np.savez(cwd / "batches.npz", **{k: np.stack([splits.train.read(b)[k] for b in keys]) for k in
                                    ("tokens", "targets", "segments")})  # fmt: skip
    np.savez(cwd / "eval.npz", **{k: v for k, v in splits.eval.stored().items() if k != "positions"})
    results = {}
    for name, lora, rate in (("LoRA", True, 3e-3), ("full", False, 1e-3)):
        start = []
        if lora:  # peft's initial adapter, saved untrained, is where both start
            np.savez(cwd / "none.npz", tokens=np.zeros((0, 8, 48), np.int64), targets=np.zeros((0, 8, 48), np.uint8))
            run([reference, REFERENCE, model, cwd / "none.npz", cwd / "init.json", "--lora", "16", "32",
                 "--save-init", cwd / "init-adapter"], cwd)  # fmt: skip
            start = ["--init-adapter", cwd / "init-adapter"]
        run([reference, REFERENCE, model, cwd / "batches.npz", cwd / f"{name}.json", "--learning-rate", str(rate),
             "--eval", cwd / "eval.npz", "--eval-every", "50", "--questions", cwd / "questions.json", *start,
             *(["--lora", "16", "32"] if lora else [])], cwd)  # fmt: skip
        theirs = json.loads((cwd / f"{name}.json").read_text())
        yaml = cwd / f"{name}.yaml"
        yaml.write_text(
            f"model: {{name: transformer_lm, pretrained: {model}{', lora: {rank: 16, alpha: 32}' if lora else ''}}}\n"
            + data
            + f"optimizer: {{name: adamw, learning_rate: {rate}, weight_decay: 0.0}}\n"
            + f"train: {{batch_size: 8, steps: {steps}, log_every: 50, eval_every: 50}}\n"
            + f"checkpoint: {{every_steps: {steps}{f', init_from: {cwd}/init-adapter' if lora else ''}}}\n"
        )
        run([BIN / "nnx-train", yaml, "--workdir", cwd / name], cwd)
        evals = {r["step"]: r["metrics"]["loss"] for r in train_records(cwd / name, "eval")}
        results[name] = (evals, theirs, answers(cwd / name, questions))
    expected = [a for _, a in pairs]
    print(f"\n24 facts, {steps} steps, batch 8, the same batches and (LoRA) the same initial adapter on both sides")
    print("\n| fine-tuning | eval loss nnx / peft at steps 50, 100, ... | facts right: nnx | peft |")
    print("| --- | --- | --- | --- |")
    ok = True
    for name, (evals, theirs, ours) in results.items():
        curve = ", ".join(f"{evals[s]:.3f}/{theirs['eval_losses'][str(s)]:.3f}" for s in sorted(evals))
        right, theirs_right = sum(map(str.__eq__, ours, expected)), sum(map(str.__eq__, theirs["answers"], expected))
        print(f"| {name} | {curve} | {right}/24 | {theirs_right}/24 |")
        ok &= right == 24
        if name == "LoRA":
            gaps = [abs(evals[s] - theirs["eval_losses"][str(s)]) / theirs["eval_losses"][str(s)]
                    for s in sorted(evals) if s > 100]  # fmt: skip
            print(f"\nLoRA eval loss, largest gap to peft after step 100: {max(gaps):.1%} (target within 10%)")
            ok &= max(gaps) <= 0.10
    return ok


def answers(workdir: Path, questions: list[str]) -> list[str]:
    """Greedy replies of a run to each question, through its chat template (as nnx-generate --chat)."""
    from nnx_cli.lm import encode_prompt, load, stops
    from nnx_cli.workdir import open_run

    _, decoder, tokenizer = load(open_run(workdir))
    out = []
    for question in questions:
        prompt = encode_prompt(tokenizer, question, chat=True, system=None)
        drawn = decoder.generate([prompt], max_tokens=24, temperature=0, **stops(tokenizer, chat=True)).finish()
        out.append(tokenizer.decode(drawn.samples[0]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch, transformers, peft")
    parser.add_argument("--part", type=int, choices=(1, 2), default=None, help="run one part only")
    parser.add_argument("--speed-steps", type=int, default=10)
    parser.add_argument("--shapes", default="smollm2,held-out", help=f"part 1's shapes, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--force", action="store_true", help="measure speed even on a busy machine (warns)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="part 1 on a GPU: bfloat16 on both sides, their peak GPU memory compared")  # fmt: skip
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    cwd = Path(tempfile.mkdtemp(prefix="nnx-lora-"))
    ok = True
    try:  # the runs' work dirs hold full checkpoints: 3.2 GB at SmolLM2's shapes, removed however the runs end
        if args.part in (None, 1):
            check_idle(args.force or DEVICE != "cpu")  # a GPU's speed does not hang on the host's load
            ok &= part1(args.reference, cwd, args.speed_steps, shapes)
        if args.part in (None, 2):
            ok &= part2(args.reference, cwd, args.steps)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
