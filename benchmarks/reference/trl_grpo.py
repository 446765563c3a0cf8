"""The TRL side of benchmarks/grpo.py: GRPO with TRL 1.16's GRPOTrainer, and rewards of completions `transformers`
samples from a model directory.

    REFERENCE_PYTHON benchmarks/reference/trl_grpo.py train MODEL_DIR TRAIN.jsonl OUT_DIR
        [--lora RANK ALPHA --save-init DIR] [--learning-rate 3e-3] [--prompts 4] [--generations 8]
        [--max-new-tokens 16] [--log-every 5] [--seed 0]
    REFERENCE_PYTHON benchmarks/reference/trl_grpo.py score MODEL_DIR PROMPTS.jsonl OUT.json
        [--generations 8] [--max-new-tokens 16] [--seed 0]

Run in the benchmark's work dir: the reward function is `bench_rewards.vowels` from there, the one nnx imports.

`train`: TRL's GRPOTrainer on the prompts of TRAIN.jsonl in file order (the benchmark writes them in the order
nnx's batches take them; `--prompts` per step, one pass), `--generations` completions of at most
`--max-new-tokens` tokens per prompt at temperature 1, TRL's default loss (dapo), beta 0, one iteration, AdamW at a
constant learning rate (no warm-up, no weight decay, gradient norm clipped at 1.0 as TRL's default), float32 on
the CPU, torch and the trainer seeded with `--seed` (the adapter's initialisation and the sampling). With
`--lora`, a PEFT adapter of that rank and alpha on all seven projections trains (saved as
initialised to `--save-init` first, so nnx starts from the same one). OUT_DIR gets `log.json` (the logged reward
and its spread, completion lengths, each step's seconds) and `model/`, the trained weights (merged, under LoRA).

`score`: `transformers` alone samples `--generations` completions of each prompt (`generate`, temperature 1, the
model's end-of-sequence ids, seed `--seed`) and scores them with the same reward function. OUT.json: the mean
reward and the completions' mean length.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, ".")
from bench_rewards import vowels

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("train", "score"))
parser.add_argument("paths", nargs=3)
parser.add_argument("--lora", nargs=2, type=float, metavar=("RANK", "ALPHA"))
parser.add_argument("--save-init")
parser.add_argument("--learning-rate", type=float, default=3e-3)
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--generations", type=int, default=8)
parser.add_argument("--max-new-tokens", type=int, default=16)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(model_dir: str, train_path: str, out_dir: str) -> None:
    import datasets
    import peft
    import trl

    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = peft.LoraConfig(r=int(args.lora[0]), lora_alpha=args.lora[1], target_modules=targets,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        model = peft.get_peft_model(model, config)
        model.save_pretrained(args.save_init)
    rows = read_jsonl(train_path)
    steps = len(rows) // args.prompts
    config = trl.GRPOConfig(
        output_dir=out_dir + "/trainer", per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.max_new_tokens, temperature=1.0,
        max_steps=steps, learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, logging_steps=args.log_every, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, fp16=False, seed=args.seed, shuffle_dataset=False,
        disable_tqdm=True,
    )  # fmt: skip
    seconds: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            seconds.append(time.perf_counter() - self.started)

    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=[vowels], args=config, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows), callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    logged = [r for r in trainer.state.log_history if "reward" in r]
    log = [{"step": r["step"], "reward": r["reward"], "reward_std": r["reward_std"],
            "completion_length": r["completions/mean_length"]} for r in logged]  # fmt: skip
    trained = trainer.model.merge_and_unload() if args.lora else trainer.model
    trained.save_pretrained(Path(out_dir) / "model")
    tokenizer.save_pretrained(Path(out_dir) / "model")
    with open(Path(out_dir) / "log.json", "w") as f:
        json.dump({"train": log, "seconds": seconds, "steps": steps, "threads": torch.get_num_threads(),
                   "trl": trl.__version__}, f)  # fmt: skip


def score(model_dir: str, prompts_path: str, out_path: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    torch.manual_seed(args.seed)
    rewards, lengths = [], []
    for row in read_jsonl(prompts_path):
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]] * args.generations)
        with torch.no_grad():
            out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                 pad_token_id=tokenizer.pad_token_id or eos[0])  # fmt: skip
        completions = []
        for sample in out[:, ids.shape[1] :].tolist():
            end = next((i + 1 for i, t in enumerate(sample) if t in eos), len(sample))
            lengths.append(end)
            completions.append(tokenizer.decode(sample[:end], skip_special_tokens=True))
        rewards.extend(r for r in vowels([row["prompt"]] * len(completions), completions) if r is not None)
    with open(out_path, "w") as f:
        json.dump({"reward": sum(rewards) / len(rewards), "completion_length": sum(lengths) / len(lengths)}, f)


if args.mode == "train":
    train(*args.paths)
else:
    score(*args.paths)
