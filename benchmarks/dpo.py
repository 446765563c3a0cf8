"""DPO with `nnx-train` against TRL 1.16's DPOTrainer: the same pairs, the same start, both curves, steps/s, and
whether a preference learnt from a few pairs holds on pairs neither side trained on.

The model: a small random Llama-shaped model (hidden 128, 4 layers, a byte-level BPE tokenizer) written here.
The task: 64 training pairs whose chosen answer is a sentence in lower case and whose rejected answer is the
same sentence in capitals; 32 held-out pairs of other sentences. Both sides train with sigmoid DPO (beta 0.1),
AdamW at a constant rate, batch 8, one pass over the pairs in the same order (nnx's batches, written out for
TRL), with LoRA (rank 8, alpha 16, all seven projections, both from the adapter peft initialised) and fully.

Printed: the train loss and reward accuracy every 5 steps and the held-out evals every 10, side by side;
steps/s of each (after compiling, and the first steps, left out); the held-out accuracy at the end (target:
at least 0.9 for nnx, where TRL reaches 1.0). Then the check of the numbers: `nnx-eval RUN
data.source=heldout.jsonl` against `transformers` computing the same DPO loss and margin from the run's
merged export (`nnx-export --dtype float32`) against the untouched base model (target: within 2e-3 relative).

    python benchmarks/dpo.py --reference /tmp/refvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load import write_model
from lora import SMALL, run, train_records, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REFERENCE = ROOT / "benchmarks/reference/trl_dpo.py"
WORDS = ("river mill boat bridge guard fiddler spring square lamp song child teacher wheat wine village morning "
         "daughter town swallow eave harbour orchard tower market chapel forge goose bell door "
         "cellar").split()  # fmt: skip
BATCH, BETA = 8, 0.1


def pairs(n: int, seed: int) -> list[dict]:
    """Answers in lower case preferred to the same answers in capitals."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.sample(WORDS, 3)
        answer = f" The {a} is by the {c}, past the {b}."
        out.append(
            {"prompt": f"Tell me about the {a} and the {b}.", "chosen": answer.lower(), "rejected": answer.upper()}
        )
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def nnx_order(cwd: Path, model: Path, steps: int) -> list[int]:
    """The pair of each row of nnx's batches, step after step (one pair per row, rows in file order)."""
    from nnx_cli.config import load_config
    from nnx_cli.data import examples

    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={model}",
                             f"data.source={cwd / 'pairs'}", "data.format=preference", "data.seq_len=127",
                             "data.packing=false", f"data.cache_dir={cwd / 'cache'}"])  # fmt: skip
    split = examples.load_example_splits(cfg.data, seed=0, pretrained=str(model), splits=("train",)).train
    per_epoch = len(split) // BATCH
    return [int(k) for s in range(steps) for k in
            split.epoch_keys(s // per_epoch)[(s % per_epoch) * BATCH : (s % per_epoch + 1) * BATCH]]  # fmt: skip


def our_ids(cwd: Path, model: Path, rows: list[dict]) -> list[list[int]]:
    """nnx's token ids of the chosen sequence of each pair, for the comparison with TRL's."""
    from nnx_cli.config import DataConfig
    from nnx_cli.data.examples import encode_parts
    from nnx_cli.data.tokenizers import load_tokenizer

    cfg = DataConfig(source="pairs", format="preference", tokenizer="pretrained")
    tokenizer = load_tokenizer("pretrained", str(model))
    return [encode_parts(cfg, tokenizer, None, row, i)[0][0] for i, row in enumerate(rows)]


def side_by_side(name: str, ours: Path, theirs: dict, steps_per_s: tuple[float, float]) -> None:
    train = {r["step"]: r["metrics"] for r in train_records(ours, "train")}
    evals = {r["step"]: r["metrics"] for r in train_records(ours, "eval")}
    print(f"\n{name}: train loss and reward accuracy (means over the last 5 steps), nnx / TRL")
    print("| step | loss nnx | loss TRL | accuracy nnx | accuracy TRL |\n| --- | --- | --- | --- | --- |")
    for record in theirs["train"]:
        mine = train.get(record["step"])
        if mine is not None:
            print(f"| {record['step']} | {mine['loss']:.4f} | {record['loss']:.4f} | {mine['reward_accuracy']:.3f} | "
                  f"{record['reward_accuracy']:.3f} |")  # fmt: skip
    print(f"\n{name}: held-out pairs (never trained on), nnx / TRL")
    print("| step | loss nnx | loss TRL | accuracy nnx | accuracy TRL | margin nnx | margin TRL |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for record in theirs["eval"]:
        mine = evals.get(record["step"])
        if mine is not None:
            print(f"| {record['step']} | {mine['loss']:.4f} | {record['loss']:.4f} | {mine['reward_accuracy']:.3f} | "
                  f"{record['reward_accuracy']:.3f} | {mine['reward_margin']:.3f} | "
                  f"{record['reward_margin']:.3f} |")  # fmt: skip
    print(f"\n{name}: {steps_per_s[0]:.1f} steps/s nnx, {steps_per_s[1]:.1f} steps/s TRL "
          f"({theirs['threads']} torch threads): {steps_per_s[0] / steps_per_s[1]:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch, transformers, trl")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    cwd = args.workdir or Path(tempfile.mkdtemp(prefix="nnx-dpo-"))
    cwd.mkdir(parents=True, exist_ok=True)
    train_pairs, heldout = pairs(64, seed=0), pairs(32, seed=1)
    write_jsonl(cwd / "pairs" / "train.jsonl", train_pairs)
    write_jsonl(cwd / "pairs" / "test.jsonl", heldout)
    write_jsonl(cwd / "heldout.jsonl", heldout)
    model = cwd / "small-llama"
    model.mkdir(parents=True, exist_ok=True)
    text = " ".join(p["prompt"] + p["chosen"] for p in train_pairs + heldout)
    write_tokenizer(model, text + " user assistant system", 600)
    count = write_model(model, {**SMALL, "vocab_size": 640, "bos_token_id": None, "eos_token_id": 2})
    order = nnx_order(cwd, model, args.steps)
    write_jsonl(cwd / "trl-train.jsonl", [train_pairs[k] for k in order])
    print(f"model: Llama-shaped, {count / 1e6:.2f} M parameters; {len(train_pairs)} training pairs, {len(heldout)} "
          f"held out; {args.steps} steps of {BATCH} pairs, sigmoid DPO, beta {BETA}")  # fmt: skip
    ok = True
    for name, lora, rate in (("LoRA r8", True, 5e-3), ("full", False, 5e-4)):
        tag = "lora" if lora else "full"
        extra = ["--lora", "8", "16", "--save-init", cwd / "init-adapter"] if lora else []
        run([args.reference, REFERENCE, "train", model, cwd / "trl-train.jsonl", cwd / "heldout.jsonl",
             cwd / f"trl-{tag}.json", "--learning-rate", str(rate), "--beta", str(BETA), *extra], cwd)  # fmt: skip
        theirs = json.loads((cwd / f"trl-{tag}.json").read_text())
        if lora:
            mine = our_ids(cwd, model, [train_pairs[k] for k in order[:4]])
            same = all(ids["prompt_ids"] + ids["chosen_ids"] == m for ids, m in zip(theirs["ids"], mine))
            print(f"\ntoken ids of the first pairs: {'the same as' if same else 'DIFFERENT from'} TRL's")
            ok &= same
        config = cwd / f"{tag}.yaml"
        config.write_text(
            f"model: {{name: transformer_lm, pretrained: {model}{', lora: {rank: 8, alpha: 16}' if lora else ''}}}\n"
            "data: {source: pairs, format: preference, seq_len: 127, packing: false, eval_split: test}\n"
            f"objective: {{name: dpo, beta: {BETA}}}\n"
            f"optimizer: {{name: adamw, learning_rate: {rate}, weight_decay: 0.0}}\n"
            f"train: {{batch_size: {BATCH}, steps: {args.steps}, log_every: 5, eval_every: 10}}\n"
            f"checkpoint: {{every_steps: {args.steps}{f', init_from: {cwd}/init-adapter' if lora else ''}}}\n"
        )
        workdir = cwd / tag
        run([BIN / "nnx-train", config, "--workdir", workdir, "--no-resume"], cwd)
        rates = [r["metrics"]["steps_per_s"] for r in train_records(workdir, "train")[2:]]  # after compiling
        theirs_rate = 1.0 / statistics.median(theirs["seconds"][5:])
        side_by_side(name, workdir, theirs, (statistics.median(rates), theirs_rate))
        out, _ = run([BIN / "nnx-eval", workdir, f"data.source={cwd / 'heldout.jsonl'}", "--json"], cwd)
        ours = json.loads(out)["metrics"]
        final = theirs["eval"][-1]["reward_accuracy"]
        print(
            f"{name}: held-out accuracy at the end: nnx {ours['reward_accuracy']:.3f}, TRL {final:.3f} "
            "(target: nnx at least 0.9)"
        )
        ok &= ours["reward_accuracy"] >= 0.9
        exported = cwd / f"{tag}-merged"
        run([BIN / "nnx-export", workdir, "--out", exported, "--dtype", "float32"], cwd)
        run([args.reference, REFERENCE, "score", exported, model, cwd / "heldout.jsonl", cwd / f"score-{tag}.json",
             "--beta", str(BETA)], cwd)  # fmt: skip
        truth = json.loads((cwd / f"score-{tag}.json").read_text())
        gaps = {k: abs(ours[k] - truth[k]) / abs(truth[k]) for k in ("loss", "reward_margin")}
        print(f"{name}: nnx-eval on held-out pairs vs transformers from the merged export against the base: loss "
              f"{ours['loss']:.6f} / {truth['loss']:.6f}, margin {ours['reward_margin']:.6f} / "
              f"{truth['reward_margin']:.6f}; largest relative gap {max(gaps.values()):.1e} (target 2e-3)")  # fmt: skip
        ok &= max(gaps.values()) <= 2e-3
    print(f"\nwork dir: {cwd}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
