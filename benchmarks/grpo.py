"""GRPO with `nnx-train` against TRL 1.16's GRPOTrainer: the same tiny random model, prompts, reward function,
steps, generations and learning rate; both reward curves, steps/s, and the mean reward of each trained model on
prompts neither side trained on.

The model: a random Llama-shaped model (hidden 64, 2 layers) over a character-level vocabulary (lower-case
letters, space and punctuation) written here. The reward, a character-level one: the share of vowels among the
characters of a completion (0 for an empty one), about 0.2 for the random model. Both sides sample 8 completions
of at most 16 tokens per prompt at temperature 1, 4 prompts per step, 40 steps, in the same order (nnx's
batches, written out for TRL), TRL's default loss (dapo) without a KL term, AdamW at a constant rate with the
gradient norm clipped at 1.0 (TRL's default), fully fine-tuned, or with LoRA (`--lora`: rank 8, alpha 16, all
seven projections, both from the adapter peft initialised).

Each side trains from each of `--seeds N` seeds (0 .. N-1: the adapter's initialisation, the prompts' order and
the sampling; both sides see the same order for a seed). Printed: the mean reward of the training batches every 5
steps, side by side (the mean over the seeds); per seed, steps/s of each (after compiling, and the first steps,
left out) and the rise that counts: the mean reward of completions that `transformers` samples
(`benchmarks/reference/trl_grpo.py score`, 8 per prompt) on 32 held-out prompts from the untouched model, from
TRL's trained model and from nnx's export (`nnx-export`, merged under LoRA), the same sampler for all three; and
`nnx-eval`'s own reward on the held-out prompts. Target: nnx's mean rise at least TRL's, or below it by less than
two standard errors of the difference of the means (the seeds' noise; with one seed, at least TRL's).

    python benchmarks/grpo.py --reference /work/refvenv/bin/python [--lora] [--learning-rate 3e-3] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load import write_model
from lora import run, train_records

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REFERENCE = ROOT / "benchmarks/reference/trl_grpo.py"
CHARS = "abcdefghijklmnopqrstuvwxyz .,?"
WORDS = (
    "river mill boat bridge guard fiddler spring square lamp song child teacher wheat wine village morning daughter "
    "town swallow eave harbour orchard tower market chapel forge goose bell door cellar"
).split()
MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "vocab_size": 3 + len(CHARS), "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
}  # fmt: skip
REWARDS = '''
def vowels(prompts, completions, **columns):
    """The share of vowels among a completion's characters (0 for an empty one)."""
    return [sum(ch in "aeiou" for ch in c) / len(c) if c else 0.0 for c in completions]
'''
PROMPTS, GENERATIONS, NEW_TOKENS, STEPS = 4, 8, 16, 40


def write_tokenizer(directory: Path) -> None:
    """A character-level tokenizer: `<s>`, `</s>`, `<unk>`, then one id per character of CHARS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "pad_token": "</s>"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"tell me about the {' and the '.join(rng.sample(WORDS, 2))}."} for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def nnx_order(cwd: Path, config: Path, steps: int) -> list[int]:
    """The prompt of each row of nnx's batches, step after step."""
    from nnx_cli.config import load_config
    from nnx_cli.data import prompts as prompt_data

    os.chdir(cwd)
    split = prompt_data.load_prompt_splits(load_config(config, []), ("train",)).train
    per_epoch = len(split) // PROMPTS
    return [int(k) for s in range(steps) for k in
            split.epoch_keys(s // per_epoch)[(s % per_epoch) * PROMPTS : (s % per_epoch + 1) * PROMPTS]]  # fmt: skip


def one_seed(args: argparse.Namespace, cwd: Path, model: Path, train: list[dict], seed: int) -> dict:
    """Both sides trained from `seed` (the adapter's initialisation, the prompts' order, the sampling), their
    training curves, steps/s, and the held-out reward of each trained model."""
    tag = "lora" if args.lora else "full"
    where = cwd / f"seed{seed}"
    where.mkdir(parents=True, exist_ok=True)
    init = where / "init-adapter"
    config = where / f"{tag}.yaml"
    config.write_text(
        f"seed: {seed}\n"
        f"model: {{name: transformer_lm, pretrained: {model}{', lora: {rank: 8, alpha: 16}' if args.lora else ''}}}\n"
        f"data: {{source: {cwd / 'prompts'}, format: prompt, seq_len: 63, eval_split: test}}\n"
        f"objective: {{name: grpo, rewards: [bench_rewards.vowels], num_generations: {GENERATIONS}, "
        f"max_new_tokens: {NEW_TOKENS}, temperature: 1.0, beta: 0.0, loss: dapo}}\n"
        f"optimizer: {{name: adamw, learning_rate: {args.rate}, weight_decay: 0.0, clip_grad_norm: 1.0}}\n"
        f"train: {{batch_size: {PROMPTS}, steps: {args.steps}, log_every: 5, eval_every: {args.steps}}}\n"
        f"checkpoint: {{every_steps: {args.steps}{f', init_from: {init}' if args.lora else ''}}}\n"
    )
    order = nnx_order(cwd, config, args.steps)
    write_jsonl(where / "trl-train.jsonl", [train[k] for k in order])
    extra = ["--lora", "8", "16", "--save-init", init] if args.lora else []
    run([args.reference, REFERENCE, "train", model, where / "trl-train.jsonl", where / f"trl-{tag}",
         "--learning-rate", str(args.rate), "--prompts", str(PROMPTS), "--generations", str(GENERATIONS),
         "--max-new-tokens", str(NEW_TOKENS), "--seed", str(seed), *extra], cwd)  # fmt: skip
    theirs = json.loads((where / f"trl-{tag}" / "log.json").read_text())
    workdir = where / tag
    run([BIN / "nnx-train", config, "--workdir", workdir, "--no-resume"], cwd)
    ours = {r["step"]: r["metrics"] for r in train_records(workdir, "train")}
    rates = [r["steps_per_s"] for step, r in sorted(ours.items())[1:]] or [ours[max(ours)]["steps_per_s"]]
    seconds = theirs["seconds"][min(5, len(theirs["seconds"]) // 2) :]  # after their first steps
    exported = where / f"{tag}-export"
    run([BIN / "nnx-export", workdir, "--out", exported, "--dtype", "float32"], cwd)
    held_out = {name: score(args, cwd, directory, where / f"score-{name}.json")
                for name, directory in (("TRL", where / f"trl-{tag}" / "model"), ("nnx", exported))}  # fmt: skip
    out, _ = run([BIN / "nnx-eval", workdir, f"data.source={cwd / 'heldout.jsonl'}", "--json"], cwd)
    return {
        "curves": {r["step"]: (ours[r["step"]]["reward"], r["reward"]) for r in theirs["train"] if r["step"] in ours},
        "rates": (statistics.median(rates), 1.0 / statistics.median(seconds)),
        "threads": theirs["threads"],
        "held_out": held_out,
        "nnx_eval": json.loads(out)["metrics"]["reward"],
    }


def score(args: argparse.Namespace, cwd: Path, directory: Path, out: Path) -> float:
    """The mean reward of completions `transformers` samples from `directory` on the held-out prompts."""
    run([args.reference, REFERENCE, "score", directory, cwd / "heldout.jsonl", out,
         "--generations", str(GENERATIONS), "--max-new-tokens", str(NEW_TOKENS)], cwd)  # fmt: skip
    return json.loads(out.read_text())["reward"]


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):+.3f}" + (f" +- {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch, transformers, trl")
    parser.add_argument("--lora", action="store_true", help="LoRA rank 8 (alpha 16) instead of full fine-tuning")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: 3e-3 full, 2e-2 LoRA")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seeds", type=int, default=1, help="train both sides from seeds 0 .. N-1")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    args.rate = args.learning_rate or (2e-2 if args.lora else 3e-3)
    cwd = (args.workdir or Path(tempfile.mkdtemp(prefix="nnx-grpo-"))).resolve()
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "bench_rewards.py").write_text(REWARDS)
    train, heldout = prompts(64, seed=0), prompts(32, seed=1)
    write_jsonl(cwd / "prompts" / "train.jsonl", train)
    write_jsonl(cwd / "prompts" / "test.jsonl", heldout)
    write_jsonl(cwd / "heldout.jsonl", heldout)
    model = cwd / "tiny-chars"
    model.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model)
    count = write_model(model, MODEL)
    print(f"model: Llama-shaped, {count / 1e6:.3f} M parameters, characters; {len(train)} training prompts, "
          f"{len(heldout)} held out; {args.steps} steps of {PROMPTS} prompts x {GENERATIONS} completions of at most "
          f"{NEW_TOKENS} tokens; reward: the share of vowels; {'lora' if args.lora else 'full'}, learning rate "
          f"{args.rate}; seeds 0-{args.seeds - 1}")  # fmt: skip
    untouched = score(args, cwd, model, cwd / "score-untouched.json")
    runs = [one_seed(args, cwd, model, train, seed) for seed in range(args.seeds)]
    print("\nmean reward of the training batches (over the last 5 steps), nnx / TRL, mean over the seeds")
    print("| step | nnx | TRL |\n| --- | --- | --- |")
    for step in runs[0]["curves"]:
        pairs = [r["curves"][step] for r in runs if step in r["curves"]]
        print(f"| {step} | {statistics.mean(p[0] for p in pairs):.3f} | {statistics.mean(p[1] for p in pairs):.3f} |")
    rises = {name: [r["held_out"][name] - untouched for r in runs] for name in ("nnx", "TRL")}
    print(
        f"\nheld-out prompts, completions sampled by transformers (8 per prompt): the untouched model {untouched:.3f}"
    )
    print("| seed | rise, nnx | TRL | steps/s, nnx | TRL | ratio | nnx-eval's reward |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seed, r in enumerate(runs):
        ours, theirs = r["rates"]
        print(f"| {seed} | {rises['nnx'][seed]:+.3f} | {rises['TRL'][seed]:+.3f} | {ours:.1f} | {theirs:.1f} | "
              f"{ours / theirs:.2f}x | {r['nnx_eval']:.3f} |")  # fmt: skip
    print(
        f"rise over {args.seeds} seed(s), mean +- standard deviation: nnx {spread(rises['nnx'])}, "
        f"TRL {spread(rises['TRL'])} ({runs[0]['threads']} torch threads, load average {os.getloadavg()[0]:.1f})"
    )
    gap = statistics.mean(rises["TRL"]) - statistics.mean(rises["nnx"])
    if args.seeds > 1:
        # not worse than TRL beyond the seeds' noise: two standard errors of the difference of the means
        noise = 2 * math.sqrt((statistics.variance(rises["nnx"]) + statistics.variance(rises["TRL"])) / args.seeds)
        print(f"nnx's mean rise {-gap:+.3f} against TRL's, noise (two standard errors) {noise:.3f}; target: "
              f"within the noise or above")  # fmt: skip
    else:
        noise = 0.0
        print("target: nnx's rise at least TRL's (one seed; --seeds 5 judges against the seeds' noise)")
    print(f"\nwork dir: {cwd}")
    raise SystemExit(0 if gap <= noise else 1)


if __name__ == "__main__":
    main()
