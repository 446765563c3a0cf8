"""The `transformers` side of benchmarks/hf_generate.py: load a model directory and generate greedily.

Run with a Python that has torch and transformers (never the project's virtualenv; tests/fixtures/README.md
says how to make one). Prints one JSON object: load time, decode tokens/s (128 new tokens per row, with the
cache; `--batch` rows of the same prompt), and the generated ids of the first row. Whole-process time is
measured by the caller; `decode_only_s` is the extra 1-token run `--decode-only` adds to it.

    REFERENCE_PYTHON benchmarks/reference/transformers_generate.py MODEL_DIR --prompt TEXT --max-tokens 128

A 4-bit model: `--save-4bit nf4 OUT` quantises MODEL_DIR with bitsandbytes as it loads (`BitsAndBytesConfig`:
double quantisation, computing in `--dtype`) and saves it to OUT as the Hub's `*-bnb-4bit` directories are;
then `MODEL_DIR` may be such a directory, which loads 4-bit as saved (`--dtype bfloat16` for the rest).
"""

import argparse
import json
import time

import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--prompt", required=True)
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--batch", type=int, default=1, help="rows of the same prompt generated together")
parser.add_argument("--decode-only", action="store_true", help="also time a 1-token run to separate the prefill")
parser.add_argument("--device", default="cpu", help="cuda: the model and the generation on the GPU")
parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the unquantised weights")
parser.add_argument("--save-4bit", nargs=2, metavar=("TYPE", "OUT"), help="quantise MODEL_DIR, save it to OUT, exit")
args = parser.parse_args()
device = torch.device(args.device)
dtype = getattr(torch, args.dtype)

if args.save_4bit:
    kind, out = args.save_4bit
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)  # fmt: skip
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, quantization_config=config, device_map=args.device
    )
    quantized.save_pretrained(out)
    print(json.dumps({"saved": out}))
    raise SystemExit(0)


def synchronize() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


start = time.perf_counter()
tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=args.device).eval()
loaded = time.perf_counter() - start
ids = tokenizer(args.prompt, return_tensors="pt").input_ids.repeat(args.batch, 1).to(device)
with torch.inference_mode():
    options = dict(do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens)
    begin = time.perf_counter()
    out = model.generate(ids, **options)
    synchronize()
    total = time.perf_counter() - begin
    first = None
    if args.decode_only:
        begin = time.perf_counter()
        model.generate(ids, do_sample=False, max_new_tokens=1, min_new_tokens=1)
        synchronize()
        first = time.perf_counter() - begin
new = out.shape[1] - ids.shape[1]
decode_s = total - first if first is not None else None
print(
    json.dumps(
        {
            "load_s": round(loaded, 3),
            "generate_s": round(total, 3),
            "decode_only_s": round(first, 3) if first is not None else 0.0,
            "tokens_per_s": round((new - 1) * args.batch / decode_s, 1) if decode_s else None,
            "tokens": out[0, ids.shape[1] :].tolist(),
            "threads": torch.get_num_threads(),
            "bf16_kernel": any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules()),
        }
    )
)
