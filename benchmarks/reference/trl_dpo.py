"""The TRL side of benchmarks/dpo.py: DPO with TRL 1.16's DPOTrainer, and DPO numbers computed by `transformers`.

    REFERENCE_PYTHON benchmarks/reference/trl_dpo.py train MODEL_DIR TRAIN.jsonl HELDOUT.jsonl OUT.json
        [--lora RANK ALPHA --save-init DIR] [--learning-rate 5e-3] [--beta 0.1] [--batch-size 8]
        [--log-every 5] [--eval-every 10]
    REFERENCE_PYTHON benchmarks/reference/trl_dpo.py score POLICY_DIR REFERENCE_DIR PAIRS.jsonl OUT.json [--beta 0.1]

`train`: TRL.16's DPOTrainer on the pairs of TRAIN.jsonl taken in file order (the benchmark writes them in the
order nnx's batches take them: one pass, `--batch-size` per step), sigmoid loss, AdamW at a constant learning
rate (no warm-up, no weight decay, no gradient clipping), float32 on the CPU. With `--lora`, a PEFT adapter of
that rank and alpha on all seven projections trains (saved as initialised to `--save-init` first, so nnx
starts from the same one) and the reference is the model with its adapter off; without, every weight trains
against a frozen copy. OUT.json: the logged train loss and reward accuracy, the held-out evals, each step's
seconds, and the token ids TRL built for the first pairs.

`score`: `transformers` alone computes the DPO loss and rewards of PAIRS.jsonl (standard form) with POLICY_DIR
against REFERENCE_DIR, by the definitions of the spec (posttrain.md): ids are `tokenizer(prompt)`, then
`tokenizer(response, add_special_tokens=False)` and `eos_token_id`; a response's log-probability sums the
log-softmax at its tokens. OUT.json: the means over pairs.
"""

import argparse
import json
import time

import numpy as np
import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("train", "score"))
parser.add_argument("paths", nargs=4)
parser.add_argument("--lora", nargs=2, type=float, metavar=("RANK", "ALPHA"))
parser.add_argument("--save-init")
parser.add_argument("--learning-rate", type=float, default=5e-3)
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--eval-every", type=int, default=10)
args = parser.parse_args()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(model_dir: str, train_path: str, heldout_path: str, out_path: str) -> None:
    import datasets
    import peft
    import trl

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = peft.LoraConfig(r=int(args.lora[0]), lora_alpha=args.lora[1], target_modules=targets,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        model = peft.get_peft_model(model, config)
        model.save_pretrained(args.save_init)
    rows = read_jsonl(train_path)
    steps = len(rows) // args.batch_size
    config = trl.DPOConfig(
        output_dir=out_path + ".trainer", per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, max_steps=steps, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, beta=args.beta,
        loss_type=["sigmoid"], logging_steps=args.log_every, eval_strategy="steps", eval_steps=args.eval_every,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False, seed=0,
        train_sampling_strategy="sequential", dataloader_drop_last=True, disable_tqdm=True,
    )  # fmt: skip
    seconds: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            seconds.append(time.perf_counter() - self.started)

    trainer = trl.DPOTrainer(
        model=model, args=config, processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(read_jsonl(heldout_path)), callbacks=[Clock()],
    )  # fmt: skip
    tokenized = trainer.train_dataset
    ids = [{k: tokenized[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in range(4)]
    trainer.train()
    logs = trainer.state.log_history
    train_log = [{"step": r["step"], "loss": r["loss"], "reward_accuracy": r["rewards/accuracies"]}
                 for r in logs if "loss" in r and "rewards/accuracies" in r]  # fmt: skip
    evals = [{"step": r["step"], "loss": r["eval_loss"], "reward_accuracy": r["eval_rewards/accuracies"],
              "reward_margin": r["eval_rewards/margins"]} for r in logs if "eval_loss" in r]  # fmt: skip
    with open(out_path, "w") as f:
        json.dump({"train": train_log, "eval": evals, "seconds": seconds, "ids": ids, "steps": steps,
                   "threads": torch.get_num_threads(), "trl": trl.__version__}, f)  # fmt: skip


def response_logps(model: torch.nn.Module, prompt: list[int], response: list[int]) -> float:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return float(logps[len(prompt) - 1 :].sum())


def score(policy_dir: str, reference_dir: str, pairs_path: str, out_path: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(reference_dir)
    models = [transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
              for d in (policy_dir, reference_dir)]  # fmt: skip
    losses, chosen, rejected = [], [], []
    for pair in read_jsonl(pairs_path):
        prompt = tokenizer(pair["prompt"])["input_ids"]
        rewards = []
        for key in ("chosen", "rejected"):
            response = tokenizer(pair[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            policy, reference = (response_logps(m, prompt, response) for m in models)
            rewards.append(args.beta * (policy - reference))
        margin = rewards[0] - rewards[1]
        losses.append(float(np.logaddexp(0.0, -margin)))  # -log sigmoid(margin)
        chosen.append(rewards[0])
        rejected.append(rewards[1])
    margins = np.subtract(chosen, rejected)
    with open(out_path, "w") as f:
        json.dump({"loss": float(np.mean(losses)), "reward_chosen": float(np.mean(chosen)),
                   "reward_rejected": float(np.mean(rejected)), "reward_margin": float(np.mean(margins)),
                   "reward_accuracy": float(np.mean(margins > 0))}, f)  # fmt: skip


if args.mode == "train":
    train(*args.paths)
else:
    score(*args.paths)
