"""The PyTorch side of benchmarks/gpt.py: a GPT (`transformer_lm`'s defaults: learned positions, pre-norm
LayerNorm blocks with biases, GELU MLP 4x wide, embeddings tied to the head) trained as a careful PyTorch
user would: bfloat16 autocast, `torch.compile`, fused AdamW, `scaled_dot_product_attention` (flash).

Data: the byte-level stream `nnx-train`'s `bytes` tokenizer makes (each text's UTF-8 bytes, then the
end-of-document id 256; vocabulary 257 padded to 384, or `--vocab`), from a Hugging Face-layout directory of
parquet files (`--data`, its `text` column), or random ids (`--random`). Batches are windows at random
offsets; the validation loss is the mean over the validation split's non-overlapping windows.

Prints one JSON object: steady tokens/s (the steps after the first `--warmup`, evaluations left out),
model FLOPs per token (`6 N + 12 layers length width`, N the parameters outside the embeddings, as
`transformer_lm` counts them), the validation loss, and the peak device memory.

    python benchmarks/reference/torch_gpt.py --layers 12 --heads 12 --width 768 --length 1024 --batch 16 \\
        --vocab 50304 --random --steps 100
"""

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--heads", type=int, default=6)
parser.add_argument("--width", type=int, default=384)
parser.add_argument("--length", type=int, default=256)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--vocab", type=int, default=384, help="embedding rows (257 ids padded)")
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--warmup", type=int, default=10, help="steps left out of the tokens/s")
parser.add_argument("--data", help="a directory of parquet splits with a `text` column")
parser.add_argument("--random", action="store_true", help="random ids instead of data (speed only)")
parser.add_argument("--learning-rate", type=float, default=1e-3)
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--eval-windows", type=int, default=0, help="of the validation split (0: all)")
parser.add_argument("--no-compile", dest="compile", action="store_false")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()
device = torch.device(args.device)
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = True


def byte_stream(split: str) -> np.ndarray:
    import pyarrow.parquet as pq

    files = sorted(Path(args.data).glob(f"{split}-*.parquet"))
    texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    return np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int64), 256) for t in texts])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(args.width), nn.LayerNorm(args.width)
        self.qkv, self.out = nn.Linear(args.width, 3 * args.width), nn.Linear(args.width, args.width)
        self.fc, self.proj = nn.Linear(args.width, 4 * args.width), nn.Linear(4 * args.width, args.width)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(args.width, dim=2)
        q, k, v = (y.view(b, t, args.heads, -1).transpose(1, 2) for y in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, args.width)
        x = x + self.drop(self.out(o))
        return x + self.drop(self.proj(F.gelu(self.fc(self.norm2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.position = nn.Embedding(args.vocab, args.width), nn.Embedding(args.length, args.width)
        self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
        self.norm, self.drop = nn.LayerNorm(args.width), nn.Dropout(args.dropout)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * args.layers) if name.endswith(("out.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        x = self.drop(self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.embed.weight.T
        return F.cross_entropy(logits.float().view(-1, args.vocab), targets.reshape(-1))


model = GPT().to(device)
embeddings = args.vocab * args.width + args.length * args.width
weights = sum(p.numel() for p in model.parameters()) - embeddings
flops_per_token = 6 * weights + 12 * args.layers * args.length * args.width
decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "position" not in n]
rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n and "position" not in n)]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=args.learning_rate, betas=(0.9, 0.99), fused=device.type == "cuda")  # fmt: skip
schedule = lambda s: min(1.0, s / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))  # noqa: E731
train = None if args.random else torch.from_numpy(byte_stream("train"))
validation = None if args.random else torch.from_numpy(byte_stream("validation"))
step_fn = torch.compile(model) if args.compile else model
generator = torch.Generator().manual_seed(0)


def batch():
    if args.random:
        ids = torch.randint(0, 257, (args.batch, args.length + 1), generator=generator)
    else:
        starts = torch.randint(0, len(train) - args.length - 1, (args.batch,), generator=generator)
        ids = torch.stack([train[s : s + args.length + 1] for s in starts.tolist()])
    ids = ids.to(device, non_blocking=True)
    return ids[:, :-1], ids[:, 1:]


def evaluate() -> float:
    model.eval()
    windows = (len(validation) - 1) // args.length
    windows = min(windows, args.eval_windows) if args.eval_windows else windows
    total = 0.0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for first in range(0, windows, args.batch):
            rows = range(first, min(first + args.batch, windows))
            ids = torch.stack([validation[r * args.length : (r + 1) * args.length + 1] for r in rows]).to(device)
            total += float(model(ids[:, :-1], ids[:, 1:])) * len(rows)
    model.train()
    return total / windows


def synchronize():
    if device.type == "cuda":
        torch.cuda.synchronize()


start = time.perf_counter()
timed, counted, losses = 0.0, 0, []
for step in range(args.steps):
    for group in optimizer.param_groups:
        group["lr"] = args.learning_rate * schedule(step)
    synchronize()
    began = time.perf_counter()
    tokens, targets = batch()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = step_fn(tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize()
    if step >= args.warmup:
        timed, counted = timed + time.perf_counter() - began, counted + 1
    if args.eval_every and (step + 1) % args.eval_every == 0 and not args.random:
        losses.append((step + 1, evaluate()))
result = {
    "tokens_per_s": counted * args.batch * args.length / timed if counted else None,
    "flops_per_token": flops_per_token,
    "val_loss": evaluate() if not args.random else None,
    "evals": losses,
    "seconds": time.perf_counter() - start,
    "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
}
print(json.dumps(result))
