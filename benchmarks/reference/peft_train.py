"""The `transformers` + `peft` side of benchmarks/lora.py: train on the batches nnx trains on.

    REFERENCE_PYTHON benchmarks/reference/peft_train.py MODEL_DIR BATCHES.npz OUT.json
        [--lora RANK ALPHA] [--init-adapter DIR] [--save-init DIR] [--learning-rate 1e-3]
        [--eval EVAL.npz --eval-every 50] [--questions QUESTIONS.json] [--load-4bit nf4 --dtype bfloat16]

BATCHES.npz holds `tokens` and `targets` `[steps, batch, length + 1]` (and `segments`, 0 on padding), as
nnx's data pipeline laid them out: each step predicts `tokens[:, 1:]` from `tokens[:, :-1]`, and the loss
is the cross-entropy averaged over the tokens marked in `targets` (per target token, as nnx computes it).
The optimizer is AdamW (betas 0.9, 0.999, eps 1e-8, no weight decay). With `--lora`, a PEFT LoRA adapter
of that rank and alpha on all seven projections trains (starting from `--init-adapter` if given; `--save-init`
writes the adapter as initialised, for nnx to start from the same point); without it, every weight trains.
With `--load-4bit nf4` the base is loaded through bitsandbytes (`BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type=nf4, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=--dtype)`): QLoRA as peft
users run it; `--dtype` is the dtype the rest of the model is loaded in (float32 by default).

Writes OUT.json: the loss of every step, each step's seconds, eval losses, and the greedy answers to
QUESTIONS.json (chat prompts) after training; with `--device cuda`, the peak GPU memory PyTorch allocated.
`--dtype bfloat16` loads the weights in bfloat16 (as peft users load a base to fine-tune on a GPU).
"""

import argparse
import json
import time

import numpy as np
import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("batches")
parser.add_argument("out")
parser.add_argument("--lora", nargs=2, type=float, metavar=("RANK", "ALPHA"))
parser.add_argument("--init-adapter")
parser.add_argument("--save-init")
parser.add_argument("--learning-rate", type=float, default=1e-3)
parser.add_argument("--eval")
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--questions")
parser.add_argument("--threads", type=int, default=0)
parser.add_argument("--load-4bit", choices=["nf4", "fp4"], help="a bitsandbytes 4-bit base (QLoRA)")
parser.add_argument("--device", default="cpu", help="cuda: the weights, batches and steps on the GPU")
parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the loaded weights")
parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward pass")
args = parser.parse_args()
device = torch.device(args.device)
if args.threads:
    torch.set_num_threads(args.threads)

dtype, quantized = getattr(torch, args.dtype), {}
if args.load_4bit:  # bitsandbytes places the 4-bit weights itself: on the device named, not moved after
    quantized = {"device_map": args.device, "quantization_config": transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=args.load_4bit, bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype)}  # fmt: skip
model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **quantized)
if not args.load_4bit:
    model = model.to(device)
if args.lora:
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if args.init_adapter:
        model = peft.PeftModel.from_pretrained(model, args.init_adapter, is_trainable=True)
    else:
        config = peft.LoraConfig(r=int(args.lora[0]), lora_alpha=args.lora[1], target_modules=targets,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        model = peft.get_peft_model(model, config)
    if args.save_init:
        model.save_pretrained(args.save_init)
if args.gradient_checkpointing:  # each decoder layer recomputed in the backward pass (model.remat: full)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        model.enable_input_require_grads()
model.train()
trainable = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def loss_of(tokens: np.ndarray, targets: np.ndarray, segments: np.ndarray | None) -> torch.Tensor:
    tokens, targets = torch.tensor(tokens).long().to(device), torch.tensor(targets).bool().to(device)
    real = torch.tensor(segments > 0).to(device) if segments is not None else torch.ones_like(tokens, dtype=torch.bool)
    labels = torch.where(targets[:, 1:] & real[:, 1:], tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
    logits = model(input_ids=tokens[:, :-1], attention_mask=real[:, :-1].long()).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=-100)  # fmt: skip


batches = np.load(args.batches)
segments = batches.get("segments", None)
evals = np.load(args.eval) if args.eval else None
losses, seconds, eval_losses = [], [], {}


def evaluate(step: int) -> None:
    model.eval()
    with torch.no_grad():
        total, count = 0.0, 0
        for i in range(len(evals["tokens"])):
            rows = {k: evals[k][i : i + 1] for k in ("tokens", "targets", "segments")}
            n = int(((rows["targets"][:, 1:] > 0) & (rows["segments"][:, 1:] > 0)).sum())
            if n:
                total += float(loss_of(rows["tokens"], rows["targets"], rows["segments"])) * n
                count += n
        eval_losses[step] = total / max(count, 1)
    model.train()


for step in range(len(batches["tokens"])):
    start = time.perf_counter()
    loss = loss_of(batches["tokens"][step], batches["targets"][step], segments[step] if segments is not None else None)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    losses.append(float(loss))  # waits for the step, on a GPU too
    seconds.append(time.perf_counter() - start)
    if evals is not None and (step + 1) % args.eval_every == 0:
        evaluate(step + 1)

answers = []
if args.questions:
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model.eval()
    with open(args.questions) as f:
        questions = json.load(f)
    with torch.no_grad():
        for question in questions:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
            out = model.generate(ids, do_sample=False, max_new_tokens=24)
            answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
result = {"losses": losses, "seconds": seconds, "eval_losses": eval_losses, "answers": answers,
          "trainable": sum(p.numel() for p in trainable), "threads": torch.get_num_threads(),
          "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None}  # fmt: skip
with open(args.out, "w") as f:
    json.dump(result, f)
