"""The PyTorch side of benchmarks/qlora.py's part 3: the matrix products of one LoRA step on a frozen base, timed.

    REFERENCE_PYTHON benchmarks/reference/torch_products.py OUT.json --hidden 896 --intermediate 4864
        --heads 14 --kv-heads 2 --head-dim 64 --vocab 151936 --layers 24 --tokens 1024 [--repeats 10]

The products a bitsandbytes QLoRA step multiplies once its weights are dequantised to bfloat16, as
`transformers` multiplies them: per decoder layer, each of the seven projections forward (`F.linear`, the
weight `[out, in]`) and its input gradient (`g @ W`); then the tied head over the whole vocabulary, forward
and its input gradient. Each product is timed alone (the fastest of `--repeats`, two threads as the trainer's
machine has), so their sum is the least time the step's products can take on this CPU. Writes OUT.json:
`{"layers": seconds, "head": seconds}` per step.
"""

import argparse
import json
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("out")
for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "layers", "tokens"):
    parser.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
parser.add_argument("--repeats", type=int, default=10)
args = parser.parse_args()
torch.manual_seed(0)


def fastest(fn, *operands) -> float:
    fn(*operands)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn(*operands)
        best = min(best, time.perf_counter() - start)
    return best


q, kv, hidden, tokens = args.heads * args.head_dim, args.kv_heads * args.head_dim, args.hidden, args.tokens
projections = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)] + [(hidden, args.intermediate)] * 2
projections.append((args.intermediate, hidden))
layer = 0.0
with torch.no_grad():
    for fan_in, fan_out in projections:
        x = torch.randn(tokens, fan_in, dtype=torch.bfloat16)
        w = torch.randn(fan_out, fan_in, dtype=torch.bfloat16)
        g = torch.randn(tokens, fan_out, dtype=torch.bfloat16)
        layer += fastest(torch.nn.functional.linear, x, w) + fastest(torch.matmul, g, w)
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    table = torch.randn(args.vocab, hidden, dtype=torch.bfloat16)
    dlogits = torch.randn(tokens, args.vocab, dtype=torch.bfloat16)
    head = fastest(torch.nn.functional.linear, h, table) + fastest(torch.matmul, dlogits, table)
with open(args.out, "w") as f:
    json.dump({"layers": layer * args.layers, "head": head, "threads": torch.get_num_threads()}, f)
